#!/usr/bin/env bash
# GPU check of the Triton attention kernels: one run, one CUDA GPU, under 8 minutes.
#
#   bench/gpu_check.sh              # from anywhere; needs .venv (scripts/setup.sh) with triton
#   PYTHON=python bench/gpu_check.sh
#
# 1. tests/kernels/test_kernels.py and tests/attention/test_triton_backend.py with RADIXSERVE_TEST_DEVICE=cuda:
#    the kernels compiled for the GPU, against their torch references and the torch backend.
# 2. python -m bench.bench_kernels: decode attention (batch 64 x 4k context) and prefix-extend
#    (2k cached prefix + 256 new tokens) in bf16 for 9q/3kv/64 and 32q/8kv/128 heads, beside
#    torch SDPA on dense copies of the same data; bandwidth and share of the card's peak.
#    Target: decode (auto split, graph time) at >= 60% of peak bandwidth.
# 3. python -m bench.bench_kernels --engine: the default model in bf16, 64 prompts x 256
#    tokens, 64 new tokens each, triton backend vs torch backend throughput.
#
# Everything printed also goes to $LOG (default bench/results/gpu_check-<time>.log).
# Exits non-zero if any stage failed or ran out of its time.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
LOG=${LOG:-bench/results/gpu_check-$(date +%Y%m%d-%H%M%S).log}
mkdir -p "$(dirname "$LOG")"
exec > >(tee -a "$LOG") 2>&1
unset TRITON_INTERPRET  # compiled kernels, never the interpreter

status=0
stage() {  # stage NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    echo
    echo "=== $name (limit ${limit}s) ==="
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@"
    local rc=$?
    echo "=== $name: exit $rc after $((SECONDS - start))s ==="
    [ "$rc" -eq 0 ] || status=1
}

echo "radixserve GPU check, $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "nvidia-smi unavailable"
if ! "$PY" -c "import sys, torch, triton; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu check: FAILED before starting: needs torch with CUDA, triton, and a visible GPU; log: $LOG"
    exit 2
fi

stage "kernel and backend tests on cuda" 200 \
    env RADIXSERVE_TEST_DEVICE=cuda "$PY" -m pytest tests/kernels/test_kernels.py tests/attention/test_triton_backend.py -q -p no:cacheprovider
stage "kernel micro-benchmarks" 130 "$PY" -m bench.bench_kernels
stage "engine throughput" 130 "$PY" -m bench.bench_kernels --engine

echo
echo "gpu check: $([ "$status" -eq 0 ] && echo PASSED || echo FAILED); log: $LOG"
exit "$status"
