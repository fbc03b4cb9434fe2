#!/usr/bin/env bash
# The CIFAR experiment on one GPU (docs/CIFAR.md, "On a GPU"): ResNet-50, batch 128, fp32,
# unified_amp's AMP (float16) and torch.amp's own (torch.autocast + torch.amp.GradScaler,
# --native) in turns through examples/cifar.py on torch, capped in time: what the layer
# costs where AMP matters, as a ratio to the native loop measured in the same run. Run it from the
# repository root on a machine with a CUDA GPU, a CUDA build of torch, numpy, matplotlib and
# tqdm; no network and no MegEngine needed. It reads CIFAR-10 from $CIFAR_DATA (default
# data/cifar-10-batches-py) when that folder holds it, and otherwise trains on a synthetic
# folder of the same size (50000 + 10000 images, written to $SYNTHETIC-50000). What it prints also
# goes to $OUT (default gpu-output/): env.txt, cifar.log, and the run's JSON and PNG.
#   PY=python3 OUT=gpu-output EPOCHS=15 BUDGET=420 bash tests/run_gpu_cifar.sh
# BUDGET: seconds of training after which no new epoch starts (the learning rate still
# drops at half and three quarters of EPOCHS); CAP: the hard limit on the whole run.
# TF32=0 turns off TF32 for float32 convolutions and matmuls (torch runs float32
# convolutions in TF32 by default on Ampere and later; a Volta has none), so that fp32 is
# true float32 as in the experiment. OPT_LEVEL=O2 trains AMP with apex's API instead.
# NATIVE=0 leaves torch.amp's run out (two runs in turns, as before 0.2.0); CONTRACT=0
# passes --no-contract (unified_amp with torch.autocast's dtypes: weights comparable byte
# for byte with torch.amp's).
# CIFAR_ARGS go last, so they override (a CPU dry run of this script, a minute or two:
# CIFAR_ARGS="--model resnet18 --width 8 --train-size 16 --test-size 10 --batch-size 8
# --epochs 1 --eval-batch-size 10" SYNTHETIC_N=40 CAP=300; width 8 or more on a CPU
# without AVX-512, docs/CIFAR.md).
set -uo pipefail
PY=${PY:-python3}
OUT=${OUT:-gpu-output}
EPOCHS=${EPOCHS:-15}
BUDGET=${BUDGET:-420}
CAP=${CAP:-540}
DATA=${CIFAR_DATA:-data/cifar-10-batches-py}
SYNTHETIC=${SYNTHETIC:-/tmp/synthetic-cifar-10}
SYNTHETIC_N=${SYNTHETIC_N:-50000}
# shellcheck source=tests/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"

if [ -f "$DATA/data_batch_1" ] || [ -f "$DATA/cifar-10-batches-py/data_batch_1" ]; then
  data=(--data "$DATA")
  echo "CIFAR-10 from $DATA" | tee -a "$OUT/env.txt"
else
  data=(--synthetic "$SYNTHETIC_N" --data "$SYNTHETIC-$SYNTHETIC_N")
  echo "no CIFAR-10 at $DATA: a synthetic folder of $SYNTHETIC_N training images at $SYNTHETIC-$SYNTHETIC_N" | tee -a "$OUT/env.txt"
fi
extra=()
if [ -n "${OPT_LEVEL:-}" ]; then extra+=(--opt-level "$OPT_LEVEL"); fi
if [ "${NATIVE:-1}" != 0 ]; then extra+=(--native); fi
if [ "${CONTRACT:-1}" = 0 ]; then extra+=(--no-contract); fi

# torch's TF32 switches are set before the example runs (it has no flag of its own for them).
timeout "$CAP" "$PY" -c '
import os, runpy, sys
import torch
if os.environ.get("TF32") == "0":
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
print("TF32 for float32: convolutions", torch.backends.cudnn.allow_tf32,
      "matmuls", torch.backends.cuda.matmul.allow_tf32, flush=True)
sys.argv = ["examples.cifar"] + sys.argv[1:]
runpy.run_module("examples.cifar", run_name="__main__")
' "${data[@]}" --model resnet50 --batch-size 128 --epochs "$EPOCHS" --time-budget "$BUDGET" \
  --out "$OUT" --no-progress "${extra[@]}" ${CIFAR_ARGS:-} 2>&1 | tee "$OUT/cifar.log"
echo "cifar exit: ${PIPESTATUS[0]}" | tee -a "$OUT/cifar.log"
