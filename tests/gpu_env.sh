# What the GPU scripts (tests/run_gpu_*.sh) do first, sourced with PY and OUT set: record
# the machine and the versions in $OUT/env.txt, and install the checkout.
mkdir -p "$OUT"
export UNIFIED_AMP_BACKEND=torch PYTHONUNBUFFERED=1

{
  date -u
  nvidia-smi -L || true
  "$PY" -c 'import torch, numpy, sys; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version(), "numpy", numpy.__version__); print(torch.cuda.get_device_name(0))'
} 2>&1 | tee "$OUT/env.txt"

# The adapters install as unified_amp.backends (package-dir), so the package must be
# installed, not just on sys.path; with no network, no build isolation and no dependencies.
"$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -3 | tee -a "$OUT/env.txt"
