#!/usr/bin/env bash
# GPU check of gaugeopt's Triton kernels: the CUDA kernel tests (float32, bfloat16, float16) and
# the kernel benchmarks, on one H100/H200 in about 6 minutes (at most ~8 with every timeout hit), offline.
#
# Hardware: one CUDA GPU (written for an H100 80GB or H200; the 7B-shaped stack needs ~60 GB).
# Image: torch 2.11 + triton 3.6 + lightning 2.6.6 + pytest + transformers (no internet needed).
# Launch, from the repository root:
#     OUT=/path/to/out bash benchmarks/gpu_check.sh
# Writes at most 7 files to $OUT (default benchmarks/results/gpu): summary.txt, gpu_tests.log,
# bench.log, kernels_<device>.{csv,md}, kernels_<device>_compile.{csv,md}.
# Every stage has its own timeout; a failing stage does not stop the next; summary.txt says
# which passed. Knobs: PYTHON (default python3), BENCH_BUDGET_S, the *_TIMEOUT variables below.

set -x
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/gpu}
PY=${PYTHON:-python3}
INSTALL_TIMEOUT=${INSTALL_TIMEOUT:-60}
TEST_TIMEOUT=${TEST_TIMEOUT:-150}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-200}
BENCH_BUDGET_S=${BENCH_BUDGET_S:-120}
COMPILE_TIMEOUT=${COMPILE_TIMEOUT:-90}
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

# ---------------------------------------------------------------- 2. kernel tests on CUDA (incl. bf16/fp16)
t0=$SECONDS
timeout "$TEST_TIMEOUT" $PY -m pytest tests/test_kernels_gpu.py tests/test_kernels_dispatch.py -q -rA \
  -p no:cacheprovider --tb=short >> "$OUT/gpu_tests.log" 2>&1
rc=$?
status tests "$(tail -n 1 "$OUT/gpu_tests.log")" $rc $((SECONDS - t0))

# ---------------------------------------------------------------- 3. benchmarks (every layer; the 7B stack second)
t0=$SECONDS
timeout "$BENCH_TIMEOUT" $PY benchmarks/kernels_bench.py --models gpt2-124m,llama-7b,gpt2-355m,gpt2-1.5b \
  --max-layers 0 --compile none --budget-s "$BENCH_BUDGET_S" --out "$OUT" > "$OUT/bench.log" 2>&1
rc=$?
status bench "$(grep -c 'ms ' "$OUT/bench.log") rows" $rc $((SECONDS - t0))

# ---------------------------------------------------------------- 4. torch.compile of the references (GPT-2 124M)
t0=$SECONDS
timeout "$COMPILE_TIMEOUT" $PY benchmarks/kernels_bench.py --models gpt2-124m --max-layers 0 --compile gpt2-124m \
  --tag compile --out "$OUT" >> "$OUT/bench.log" 2>&1
rc=$?
status compile "$(grep -c 'torch.compile' "$OUT/bench.log") compiled rows" $rc $((SECONDS - t0))

# ---------------------------------------------------------------- summary
set +x
echo "==================== summary ($OUT)"
cat "$SUMMARY"
echo "==================== failures (tests)"
grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -20
for md in "$OUT"/kernels_*.md; do [ -f "$md" ] && { echo "==================== $md"; cat "$md"; }; done
ls -la "$OUT"
