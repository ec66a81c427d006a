#!/usr/bin/env bash
# GPU check of gaugeopt in one call of at most 8 minutes (~7 with every stage at its timeout), offline:
#   1. install (30 s)            editable install, or a sitecustomize shim mapping gaugeopt.kernels onto kernels/
#   2. tests (100 s)             the CUDA tests: Triton kernels in float32/bf16/fp16, dispatch, the dense
#                                projection's CUDA layout against float64 on CPU
#   3. speed (180 s)             benchmarks/speed.py --device cuda: every model shape and op, ratios to one fused
#                                AdamW step, GB/s against a measured copy, LRM/plain tokens/s under
#                                torch.compile + bf16 (gpt2-124m); stops starting rows after BENCH_BUDGET_S
#   4. bf16 drift (110 s)        benchmarks/bf16_drift_training.py: GPT-2 124M with LRM, condition C, 300 steps,
#                                float32 vs bf16 autocast, Q/K and V/O drift every 10 steps
#   5. trust (60 s)              benchmarks/trust_cost.py --device cuda: the one-time proof of GPT-2 124M and a
#                                Llama-3.2-1B-shaped model, the static checks, the per-step re-check vs fused AdamW
#
# Hardware: one CUDA GPU (written for an H100 80GB or H200; llama-gqa runs 4 of its 32 layers so that
# fp32 AdamW state fits). Image: torch + triton + pytest (+ lightning, transformers for the test zoo).
# Launch, from the repository root:
#     OUT=/path/to/out bash benchmarks/gpu_check.sh
# Writes to $OUT (default benchmarks/results/gpu): summary.txt, gpu_tests.log, speed.log,
# speed_<device>.{md,json}, drift.log, bf16_drift_<device>.json. Every stage has its own timeout; a failing
# stage does not stop the next; summary.txt says which passed. Knobs: PYTHON (default python3), the
# *_TIMEOUT variables and BENCH_BUDGET_S below.

set -x
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/gpu}
PY=${PYTHON:-python3}
INSTALL_TIMEOUT=${INSTALL_TIMEOUT:-30}
TEST_TIMEOUT=${TEST_TIMEOUT:-100}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-180}
BENCH_BUDGET_S=${BENCH_BUDGET_S:-145}
DRIFT_TIMEOUT=${DRIFT_TIMEOUT:-110}
TRUST_TIMEOUT=${TRUST_TIMEOUT:-60}
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
unset GAUGEOPT_BACKEND TRITON_INTERPRET
status() { echo "$1: $2 (exit $3, $4 s)" | tee -a "$SUMMARY"; }

# ---------------------------------------------------------------- 0. environment
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  $PY -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
  git log --oneline -1 2>/dev/null
} >> "$SUMMARY" 2>&1

# ---------------------------------------------------------------- 1. install (offline, editable)
t0=$SECONDS
timeout "$INSTALL_TIMEOUT" $PY -m pip install -e . --no-deps --no-build-isolation -q > "$OUT/gpu_tests.log" 2>&1
rc=$?
if ! $PY -c "import gaugeopt.kernels.dispatch" >> "$OUT/gpu_tests.log" 2>&1; then
  # fallback: map gaugeopt.kernels onto kernels/ without installing (what pyproject's package-dir does)
  SHIM=$(mktemp -d)
  printf 'import sys\nsys.path.insert(0, %r)\nimport gaugeopt\ngaugeopt.__path__.append(%r)\n' "$PWD" "$PWD" > "$SHIM/sitecustomize.py"
  export PYTHONPATH="$SHIM:$PWD:${PYTHONPATH:-}"
  $PY -c "import gaugeopt.kernels.dispatch" >> "$OUT/gpu_tests.log" 2>&1 && rc=0 || rc=1
  status install "editable install failed, using the sitecustomize shim" $rc $((SECONDS - t0))
else
  status install "gaugeopt.kernels importable" $rc $((SECONDS - t0))
fi

# ---------------------------------------------------------------- 2. CUDA tests (incl. bf16/fp16)
t0=$SECONDS
timeout "$TEST_TIMEOUT" $PY -m pytest tests/kernels/test_kernels_gpu.py tests/kernels/test_kernels_dispatch.py -q -rA \
  -p no:cacheprovider --tb=short >> "$OUT/gpu_tests.log" 2>&1
rc=$?
status tests "$(tail -n 1 "$OUT/gpu_tests.log")" $rc $((SECONDS - t0))

# ---------------------------------------------------------------- 3. speed: every shape, every op, one table
t0=$SECONDS
timeout "$BENCH_TIMEOUT" $PY benchmarks/speed.py --device cuda --budget-s "$BENCH_BUDGET_S" --out "$OUT" \
  > "$OUT/speed.log" 2>&1
rc=$?
status speed "$(grep -c '^| ' "$OUT/speed.log") table lines" $rc $((SECONDS - t0))

# ---------------------------------------------------------------- 4. bf16 drift at GPT-2 124M shape
t0=$SECONDS
DEV=$($PY -c "import re, torch; print(re.sub('[^a-z0-9]+', '-', torch.cuda.get_device_name().lower()).strip('-'))" 2>/dev/null || echo gpu)
timeout "$DRIFT_TIMEOUT" $PY benchmarks/bf16_drift_training.py --device cuda --steps 300 --every 10 --tokens 8x512 \
  --json "$OUT/bf16_drift_$DEV.json" > "$OUT/drift.log" 2>&1
rc=$?
status drift "$(grep -c '^| [0-9]' "$OUT/drift.log") curve rows" $rc $((SECONDS - t0))

# ---------------------------------------------------------------- summary
set +x
echo "==================== summary ($OUT)"
cat "$SUMMARY"
echo "==================== failures (tests)"
grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -20
for md in "$OUT"/speed_*.md; do [ -f "$md" ] && { echo "==================== $md"; cat "$md"; }; done
echo "==================== bf16 drift"
cat "$OUT/drift.log"
ls -la "$OUT"

# ---------------------------------------------------------------- 5. the cost of trust (proof, checks, re-check)
t0=$SECONDS
timeout "$TRUST_TIMEOUT" $PY benchmarks/trust_cost.py --device cuda --out "$OUT/trust_cost_$DEV.md" > "$OUT/trust.log" 2>&1
rc=$?
status trust "$(grep -c '^| [GL]' "$OUT/trust.log") rows" $rc $((SECONDS - t0))
