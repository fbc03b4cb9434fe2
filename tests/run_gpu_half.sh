#!/usr/bin/env bash
# The real-GPU half of the suite (docs/GPU.md, "runbook"): run from the repository root on a
# machine with a CUDA GPU and a CUDA build of torch, no network needed. Everything it prints
# also goes to $OUT (default gpu-output/): env.txt, pytest.log, junit.xml, bench.log and the
# benchmarks' results (throughput-*.json, overhead-workloads-*.json). Each step has a time cap so that one call fits a short GPU lease.
#   PY=python3 OUT=gpu-output PYTEST_WORKERS=4 PYTEST_ARGS=... BENCH_ARGS=--quick bash tests/run_gpu_half.sh
# 4 workers by default: with 16 (one per core) each worker's CUDA start-up and the tests
# that start interpreters, compilers or process groups of their own timed out at 50 s
# per test on the H100 machine (docs/GPU.md). Give pytest-timeout a per-test limit of a
# few minutes there (PYTEST_ARGS="--timeout 240"), not 50 s.
set -uo pipefail
PY=${PY:-python3}
OUT=${OUT:-gpu-output}
WORKERS=${PYTEST_WORKERS:-4}
# shellcheck source=tests/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"

# The whole suite but the runners (their own environments, tests/integrations): on a GPU
# the "cuda" parametrizations of tests/contract run instead of skipping, and
# tests/native/test_torch_cuda_syncs.py counts the real host syncs.
xdist=()
if "$PY" -c 'import xdist' 2>/dev/null && [ "$WORKERS" != 0 ]; then xdist=(-n "$WORKERS"); fi
# Each failure is written to failures.txt as it happens (tests/live_failures.py): a run cut
# off by its cap still names what failed and why.
LIVE_FAILURES="$OUT/failures.txt" timeout "${PYTEST_CAP:-400}" "$PY" -m pytest tests \
  --ignore tests/integrations -q -rs -p no:cacheprovider -p tests.live_failures "${xdist[@]}" --junitxml "$OUT/junit.xml" ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest.log"
echo "pytest exit: ${PIPESTATUS[0]}" | tee -a "$OUT/pytest.log"

# The GPU figures (docs/BENCHMARKS.md): AMP against fp32 throughput, then unified_amp's
# step against torch.amp's, each result in the one format under $OUT, each capped.
for name in throughput overhead; do
  sections=$([ "$name" = overhead ] && echo "--sections workloads" || echo "")
  timeout "${BENCH_CAP:-150}" "$PY" -m benchmarks "$name" $sections --device cuda --out "$OUT" \
    ${BENCH_ARGS:---quick} 2>&1 | tee -a "$OUT/bench.log"
  echo "bench $name exit: ${PIPESTATUS[0]}" | tee -a "$OUT/bench.log"
done
