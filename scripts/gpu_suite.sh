#!/usr/bin/env bash
# The one script for a GPU machine: environment report, GPU test suite, binned-routing benchmark (when present),
# optional tile tuning, then the MoE benchmark; prints the benchmark's short table last.
#
#   bash scripts/gpu_suite.sh            # quick benchmark (T = 1, 4, 16, 128, 1024, 4096, 16384; all models)
#   bash scripts/gpu_suite.sh full       # every T from 1 to 16384
#
# Environment knobs: SUITE_TRAIN=1 (also the training benchmark, scripts/bench_train.py; SUITE_TRAIN_LIGER=model,...
# adds Liger-Kernel where its wheel is carried, minutes of autotuning per shape), OUT (output folder, default ./gpu-out), SUITE_BUDGET_S (wall-clock budget of the whole script,
# default 540), SUITE_TESTS=0 (skip pytest), SUITE_BINNED=0 (skip the binned-routing benchmark), SUITE_TEST_PATHS (what pytest runs, default tests), PYTEST_ARGS (extra pytest arguments), PYTEST_BUDGET_S (default 240), SUITE_TUNE="model,model"
# (run scripts/tune first; its table is used by the benchmark and copied to $OUT), BENCH_ARGS (extra benchmark
# arguments), MOE_DISPATCH_COMMIT (recorded in the results when .git is absent).
#
# Files under $OUT (at most 8 come back, two folders deep): suite.log, pytest.log, failures.txt (only when a test
# failed: id and message of each failure as it happened), bench/{bench.json, bench.md,
# roofline.png, summary.txt}, binned/binned.json (scripts/bench_binned.py) and, with SUITE_TUNE, the tuned table and
# its tuning log in place of roofline.png (redrawn from bench.json when wanted).
set -uo pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python3}"
source scripts/_env.sh  # $python, and PYTHONPATH for the scripts' imports
OUT="${OUT:-$PWD/gpu-out}"
mkdir -p "$OUT"
mode="${1:-quick}"
budget="${SUITE_BUDGET_S:-540}"
start=$(date +%s)
log="$OUT/suite.log"
left() { echo $((budget - ($(date +%s) - start))); }
say() { echo "== $* (t=$(( $(date +%s) - start ))s)" | tee -a "$log"; }

say "environment"
{
  uname -a
  nvidia-smi || true
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,clocks.max.sm,power.draw,power.limit,temperature.gpu \
    --format=csv || true
  python3 -c 'import sys, torch, triton; print("python", sys.version.split()[0], "torch", torch.__version__,
"cuda", torch.version.cuda, "triton", triton.__version__, "device", torch.cuda.get_device_name(0))'
} 2>&1 | tee -a "$log"

if compgen -G ".whl/*.whl" > /dev/null; then
  say "installing carried wheels"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    2>&1 | tee -a "$log"
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi

pytest_summary="pytest: skipped"
if [ "${SUITE_TESTS:-1}" != "0" ]; then
  say "GPU test suite"
  per_test=()
  if python3 -c "import pytest_timeout" 2>/dev/null; then per_test=(--timeout 300); fi
  limit=$(( $(left) / 2 ))
  [ "$limit" -gt "${PYTEST_BUDGET_S:-240}" ] && limit="${PYTEST_BUDGET_S:-240}"
  # failures are written as they happen (tests/conftest.py), so a run cut by the limit still says why
  MOE_DISPATCH_FAILURE_LOG="$OUT/failures.txt" timeout "$limit" python3 -m pytest ${SUITE_TEST_PATHS:-tests} -q -p no:cacheprovider \
    --tb=line -rfE "${per_test[@]}" ${PYTEST_ARGS:-} > "$OUT/pytest.log" 2>&1
  rc=$?
  tail -n 25 "$OUT/pytest.log" | tee -a "$log"
  if [ -s "$OUT/failures.txt" ]; then echo "--- failures as they happened:"; cut -c1-300 "$OUT/failures.txt"; fi \
    | tee -a "$log"
  pytest_summary="pytest: rc=$rc ($( [ $rc = 124 ] && echo "timed out after ${limit}s" || tail -n 1 "$OUT/pytest.log"))"
fi

if [ "${SUITE_BINNED:-1}" != "0" ] && [ -f scripts/bench_binned.py ] && [ "$(left)" -gt 120 ]; then
  say "binned routing benchmark"
  mkdir -p "$OUT/binned"
  timeout 90 "$python" scripts/bench_binned.py --json "$OUT/binned/binned.json" 2>&1 | tee -a "$log"
fi

if [ -n "${SUITE_TRAIN:-}" ] && [ "$(left)" -gt 240 ]; then
  say "training benchmark (forward + backward; Liger on: ${SUITE_TRAIN_LIGER:-none})"
  timeout $(( $(left) / 2 )) "$python" scripts/bench_train.py --out "$OUT/train" --rep-ms 100 \
    --liger-models "${SUITE_TRAIN_LIGER:-none}" 2>&1 | tee -a "$log"
  rm -f "$OUT/train/train.json"  # the table is in train.md and suite.log; $OUT keeps to 8 files
fi

if [ -n "${SUITE_TUNE:-}" ] && [ "$(left)" -gt 180 ]; then
  say "tile tuning: $SUITE_TUNE"
  key=$(python3 -c 'import re, torch; print(re.sub(r"[^A-Za-z0-9]+", "_", torch.cuda.get_device_name(0)).strip("_"))')
  timeout $(( $(left) - 150 )) "$python" scripts/tune.py --models "$SUITE_TUNE" --budget-s $(( $(left) - 200 )) \
    2>&1 | tee -a "$log"
  cp "torch-ext/moe_dispatch/configs/$key.json" "docs/results/tuning-$key.json" "$OUT/" 2>/dev/null || true
fi

say "benchmark ($mode)"
quick=(--quick)
[ "$mode" = "full" ] && quick=()
nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader 2>&1 | tee -a "$log"
remaining=$(left)
timeout "$remaining" "$python" scripts/bench.py "${quick[@]}" --out "$OUT/bench" --deadline-s $((remaining - 40)) \
  ${BENCH_ARGS:-} >> "$log" 2>&1
bench_rc=$?
nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader 2>&1 | tee -a "$log"

[ -n "${SUITE_TUNE:-}" ] && rm -f "$OUT/bench/roofline.png"  # keeps the files under $OUT at 8

say "done"
echo "$pytest_summary" | tee -a "$log"
echo "bench: rc=$bench_rc$( [ $bench_rc = 124 ] && echo ' (timed out)'), outputs in $OUT/bench" | tee -a "$log"
if [ "$bench_rc" != 0 ]; then echo "--- end of the benchmark log:"; tail -n 20 "$log" | grep -v '^==' ; fi
if [ -f "$OUT/bench/summary.txt" ]; then cat "$OUT/bench/summary.txt"; fi
