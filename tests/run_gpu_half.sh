#!/usr/bin/env bash
# The real-GPU half of the suite (docs/GPU.md, "runbook"): run from the repository root on a
# machine with a CUDA GPU and a CUDA build of torch, no network needed. Everything it prints
# also goes to $OUT (default gpu-output/): env.txt, bench.log, rows.log, pytest.log,
# failures.txt, junit-rows.xml, junit.xml and the benchmarks' results
# (overhead-eager-*.json, throughput-precisions-*.json).
# The whole call fits one 10-minute device call: TOTAL_CAP seconds (default 540) from the
# start, install included; each step is capped by its own cap and by what is left of it.
#   PY=python3 OUT=gpu-output PYTEST_WORKERS=4 PYTEST_ARGS=... bash tests/run_gpu_half.sh
# 4 workers by default: with 16 (one per core) each worker's CUDA start-up and the tests
# that start interpreters, compilers or process groups of their own timed out at 50 s
# per test on the H100 machine (docs/GPU.md). Give pytest-timeout a per-test limit of a
# few minutes there (PYTEST_ARGS="--timeout 240"), not 50 s.
set -uo pipefail
PY=${PY:-python3}
OUT=${OUT:-gpu-output}
WORKERS=${PYTEST_WORKERS:-4}
DEVICE=${BENCH_DEVICE:-cuda}  # cpu: a dry run of the script on a machine without a GPU
DEADLINE=$((SECONDS + ${TOTAL_CAP:-540}))
# shellcheck source=tests/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"

# The smaller of a step's own cap ($1) and the seconds left before the deadline (at least 1).
cap() { local left=$((DEADLINE - SECONDS)); echo $(( $1 < left ? $1 : (left > 1 ? left : 1) )); }

bench() {  # one benchmark, capped, its result in the one format under $OUT
  local limit=$1; shift
  timeout "$(cap "$limit")" "$PY" -m benchmarks "$@" --device "$DEVICE" --out "$OUT" \
    2>&1 | tee -a "$OUT/bench.log"
  echo "bench $* exit: ${PIPESTATUS[0]}" | tee -a "$OUT/bench.log"
}

# First the eager training step beside torch.amp's (docs/BENCHMARKS.md, overhead / eager):
# amp.autocast() and amp.autocast(contract=False) with amp.GradScaler against
# torch.autocast + torch.amp.GradScaler, at the GPU sizes and at the launch-bound CPU
# ones, with the calls a forward makes into torch and into unified_amp. About a minute on
# an H200; it is what a GPU block's cost is read from.
bench "${EAGER_CAP:-150}" overhead --sections eager ${EAGER_ARGS:-}

# Every row of the dtype contract on real CUDA kernels before anything else, so a cap that
# cuts the whole suite short never cuts these: each row's sample call in float16 and
# bfloat16, with float32 and low inputs: its dtype, its values against float32 within the
# low dtype's tolerance and its gradients' dtypes (tests/contract/test_dtype_table.py, the
# "cuda" device; fake CUDA checks only dtypes on CPU machines).
LIVE_FAILURES="$OUT/failures.txt" timeout "$(cap "${ROWS_CAP:-150}")" "$PY" -m pytest \
  tests/contract/test_dtype_table.py -k cuda -q -rs -p no:cacheprovider -p tests.live_failures \
  --junitxml "$OUT/junit-rows.xml" 2>&1 | tee "$OUT/rows.log"
echo "rows exit: ${PIPESTATUS[0]}" | tee -a "$OUT/rows.log"

# The whole suite but the runners (their own environments, tests/integrations): on a GPU
# the "cuda" parametrizations of tests/contract run instead of skipping, and
# tests/native/test_torch_cuda_syncs.py counts the real host syncs.
xdist=()
if "$PY" -c 'import xdist' 2>/dev/null && [ "$WORKERS" != 0 ]; then xdist=(-n "$WORKERS"); fi
# Each failure is written to failures.txt as it happens (tests/live_failures.py): a run cut
# off by its cap still names what failed and why.
LIVE_FAILURES="$OUT/failures.txt" timeout "$(cap "${PYTEST_CAP:-300}")" "$PY" -m pytest tests \
  --ignore tests/integrations -q -rs -p no:cacheprovider -p tests.live_failures "${xdist[@]}" \
  --junitxml "$OUT/junit.xml" ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest.log"
echo "pytest exit: ${PIPESTATUS[0]}" | tee -a "$OUT/pytest.log"

# Then AMP against fp32 (throughput and peak memory), with what time is left.
if [ $((DEADLINE - SECONDS)) -gt 20 ]; then
  bench "${BENCH_CAP:-90}" throughput --sections precisions ${BENCH_ARGS:---rounds 5}
fi
echo "runbook: $SECONDS s" | tee -a "$OUT/bench.log"
