#!/usr/bin/env bash
# The one script for a GPU machine: environment report, GPU test suite, binned-routing benchmark (when present),
# optional training benchmark and tile tuning, then the MoE benchmark. Ends with a one-screen summary (each stage,
# its exit status, pytest's counts) and exits non-zero when any stage failed.
#
#   bash scripts/gpu_suite.sh            # quick benchmark (T = 1, 4, 16, 128, 1024, 4096, 16384; all models)
#   bash scripts/gpu_suite.sh full       # every T from 1 to 16384
#
# Python: $PYTHON when set, else the project's .venv/bin/python, else python3 (scripts/_env.sh); the first line of the
# report says which one runs and why.
#
# Environment knobs (none needed):
#   OUT                     output folder (default ./gpu-out)
#   SUITE_WHEELS=0          do not install the carried wheels of .whl/ (into ${TMPDIR:-/tmp}/moe-dispatch-site, put
#                           first on PYTHONPATH)
#   SUITE_TESTS=0           skip pytest. SUITE_TEST_PATHS: what pytest runs (default tests); PYTEST_ARGS: extra
#                           arguments; PYTEST_BUDGET_S: a time limit for each pytest process (default none)
#   SUITE_PYTEST_WORKERS=N  scripts/test's pytest-xdist workers sharing the GPU (default 4; 0: one process). Tests are
#                           handed out one by one as workers free up (--dist load), and each test returns its cached
#                           GPU memory to the driver (tests/conftest.py), so the processes do not starve each other.
#   SUITE_BINNED=0          skip the binned-routing benchmark (scripts/bench_binned.py)
#   SUITE_TRAIN=1           also the training benchmark (scripts/bench_train.py); SUITE_TRAIN_LIGER=model,... adds
#                           Liger-Kernel where its wheel is installed (minutes of autotuning per shape)
#   SUITE_TUNE="model,..."  run scripts/tune first; its table is used by the benchmark and copied to $OUT
#   SUITE_BENCH=0           skip the MoE benchmark (scripts/bench.py); BENCH_ARGS: extra benchmark arguments
#   SUITE_BUDGET_S          a wall-clock budget for the whole script: a stage that would start with too little of it
#                           left is skipped (and counts as failed), and the last ones get what remains (default none)
#   MOE_DISPATCH_COMMIT     the commit recorded in results when .git is absent
#
# Files under $OUT: suite.log (everything, in order), pytest.log,
# failures.txt (only when a test failed: id and message of each failure as it happened), test-seconds.txt (each test's
# seconds as it ended), bench/ (bench.json,
# bench.md, summary.txt, roofline.png when matplotlib imports), binned/binned.json, train/ and, with SUITE_TUNE, the
# tuned table and its tuning log.
set -uo pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ -n "${PYTHON:-}" ]; then python_why="\$PYTHON"
elif [ -x .venv/bin/python ]; then python_why="the project's .venv"
else python_why="python3 on PATH (no \$PYTHON, no .venv)"; fi
source scripts/_env.sh  # $python ($PYTHON, else .venv/bin/python, else python3), and PYTHONPATH for the imports
OUT="${OUT:-$PWD/gpu-out}"
mkdir -p "$OUT"
mode="${1:-quick}"
start=$(date +%s)
log="$OUT/suite.log"
: > "$log"
elapsed() { echo $(( $(date +%s) - start )); }
# Seconds of SUITE_BUDGET_S left, or empty without a budget.
left() { [ -n "${SUITE_BUDGET_S:-}" ] && echo $(( SUITE_BUDGET_S - $(elapsed) )); }
say() { echo "== $* (t=$(elapsed)s)" | tee -a "$log"; }
# `limited SECONDS cmd...`: cmd under `timeout` when SECONDS is set, as is otherwise.
limited() { local s="$1"; shift; if [ -n "$s" ]; then timeout "$s" "$@"; else "$@"; fi; }

stage_names=(); stage_rcs=(); stage_notes=()
record() { stage_names+=("$1"); stage_rcs+=("$2"); stage_notes+=("$3"); }
# `enough NAME SECONDS`: true when no budget is set or at least SECONDS of it are left; else records NAME as skipped.
enough() {
  local l; l="$(left)"
  if [ -z "$l" ] || [ "$l" -ge "$2" ]; then return 0; fi
  record "$1" 1 "skipped: ${l}s of SUITE_BUDGET_S left, needs ${2}s"
  return 1
}
pytest_counts() {  # pytest's closing counts in a log ("3 failed, 997 passed, 32 skipped"), one per pytest run in it
  local counts
  counts=$(grep -E '[0-9]+ (passed|failed|skipped|errors?|deselected).* in [0-9.]+s' "$1" | while IFS= read -r line; do
    echo "$line" | grep -Eo '[0-9]+ (passed|failed|skipped|errors?|xfailed|xpassed)' | paste -sd, - | sed 's/,/, /g'
  done | grep -v '^$' | paste -sd';' - | sed 's/;/; /g')  # a run that selected nothing adds no entry
  echo "${counts:-no summary line}"
}
pytest_note() {  # rc log -> the summary's note for one pytest process
  case "$1" in
    0) echo "ok: $(pytest_counts "$2")" ;;
    5) echo "FAILED: no tests collected ($(basename "$2"))" ;;
    124) echo "FAILED: timed out after ${PYTEST_BUDGET_S}s: $(pytest_counts "$2") ($(basename "$2"))" ;;
    *) echo "FAILED: $(pytest_counts "$2") ($(basename "$2"))" ;;
  esac
}

say "environment"
{
  echo "python: $python ($python_why)"
  uname -a
  nvidia-smi || true
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,clocks.max.sm,power.draw,power.limit,temperature.gpu \
    --format=csv || true
} 2>&1 | tee -a "$log"
"$python" -c 'import sys, torch, triton
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none (torch sees no GPU)"
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "triton",
      triton.__version__, "device", gpu)' 2>&1 | tee -a "$log"
rc=${PIPESTATUS[0]}
record "environment" "$rc" "$( [ "$rc" = 0 ] && echo "ok: $("$python" -V 2>&1) at $python" || echo "FAILED: $python cannot import torch and triton")"

if [ "${SUITE_WHEELS:-1}" != "0" ] && compgen -G ".whl/*.whl" > /dev/null; then
  say "installing carried wheels"
  site="${TMPDIR:-/tmp}/moe-dispatch-site"  # outside the checkout and $OUT: neither is meant to hold installed packages
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
    .whl/*.whl 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  record "carried wheels" "$rc" "$( [ "$rc" = 0 ] && echo "ok: $(ls .whl/*.whl | wc -l) into $site" || echo FAILED)"
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi

if [ "${SUITE_TESTS:-1}" != "0" ]; then
  per_test=()
  if "$python" -c "import pytest_timeout" 2>/dev/null; then per_test=(--timeout 300); fi
  workers="${SUITE_PYTEST_WORKERS:-4}"
  say "GPU test suite: scripts/test ${SUITE_TEST_PATHS:-tests} on ${workers} pytest-xdist workers"
  # scripts/test, the test command, with this python as it is; failures are written as they happen
  # (tests/conftest.py), so a run cut by its limit still says why
  # shellcheck disable=SC2086  # PYTEST_ARGS and SUITE_TEST_PATHS are word lists
  PYTHON="$python" MOE_DISPATCH_TEST_WORKERS="$workers" MOE_DISPATCH_FAILURE_LOG="$OUT/failures.txt" \
    MOE_DISPATCH_TIMES_LOG="$OUT/test-seconds.txt" \
    limited "${PYTEST_BUDGET_S:-}" bash scripts/test -q -p no:cacheprovider --tb=line -rfE "${per_test[@]}" \
    ${PYTEST_ARGS:-} ${SUITE_TEST_PATHS:-tests} > "$OUT/pytest.log" 2>&1
  rc=$?
  tail -n 40 "$OUT/pytest.log" | tee -a "$log"
  record "pytest" "$rc" "$(pytest_note "$rc" "$OUT/pytest.log")"
  for f in "$OUT"/failures*.txt; do
    if [ -s "$f" ]; then echo "--- failures as they happened ($(basename "$f")):"; cut -c1-300 "$f"; fi
  done | tee -a "$log"
else
  record "pytest" - "skipped (SUITE_TESTS=0)"
fi

if [ "${SUITE_BINNED:-1}" = "0" ] || [ ! -f scripts/bench_binned.py ]; then
  record "binned benchmark" - "skipped ($( [ -f scripts/bench_binned.py ] && echo SUITE_BINNED=0 || echo 'no scripts/bench_binned.py'))"
elif enough "binned benchmark" 120; then
  say "binned routing benchmark"
  mkdir -p "$OUT/binned"
  limited "$(left)" "$python" scripts/bench_binned.py --json "$OUT/binned/binned.json" 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  record "binned benchmark" "$rc" "$( [ "$rc" = 0 ] && echo "ok: binned/binned.json" || echo FAILED)"
fi

if [ -n "${SUITE_TRAIN:-}" ] && enough "training benchmark" 240; then
  say "training benchmark (forward + backward; Liger on: ${SUITE_TRAIN_LIGER:-none})"
  limited "$(left)" "$python" scripts/bench_train.py --out "$OUT/train" --rep-ms 100 \
    --liger-models "${SUITE_TRAIN_LIGER:-none}" 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  record "training benchmark" "$rc" "$( [ "$rc" = 0 ] && echo "ok: train/" || echo FAILED)"
fi

if [ -n "${SUITE_TUNE:-}" ] && enough "tile tuning" 180; then
  say "tile tuning: $SUITE_TUNE"
  key=$("$python" -c 'import re, torch; print(re.sub(r"[^A-Za-z0-9]+", "_", torch.cuda.get_device_name(0)).strip("_"))')
  tune_budget=()
  [ -n "$(left)" ] && tune_budget=(--budget-s $(( $(left) - 200 )))
  limited "$(left)" "$python" scripts/tune.py --models "$SUITE_TUNE" "${tune_budget[@]}" 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  cp "torch-ext/moe_dispatch/configs/$key.json" "docs/results/tuning-$key.json" "$OUT/" 2>/dev/null || true
  record "tile tuning" "$rc" "$( [ "$rc" = 0 ] && echo "ok: $key.json" || echo FAILED)"
fi

if [ "${SUITE_BENCH:-1}" = "0" ]; then
  record "benchmark" - "skipped (SUITE_BENCH=0)"
elif enough "benchmark" 60; then
  say "benchmark ($mode)"
  quick=(--quick)
  [ "$mode" = "full" ] && quick=()
  deadline=()
  [ -n "$(left)" ] && deadline=(--deadline-s $(( $(left) - 40 )))
  nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader 2>&1 | tee -a "$log"
  # shellcheck disable=SC2086
  limited "$(left)" "$python" scripts/bench.py "${quick[@]}" --out "$OUT/bench" "${deadline[@]}" ${BENCH_ARGS:-} \
    >> "$log" 2>&1
  rc=$?
  nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader 2>&1 | tee -a "$log"
  if [ "$rc" != 0 ]; then echo "--- end of the benchmark log:"; tail -n 20 "$log" | grep -v '^=='; fi
  if [ -f "$OUT/bench/summary.txt" ]; then cat "$OUT/bench/summary.txt"; fi
  note="ok: bench/"
  [ "$rc" = 124 ] && note="FAILED: timed out (SUITE_BUDGET_S)"
  [ "$rc" != 0 ] && [ "$rc" != 124 ] && note="FAILED (the end of suite.log says why)"
  [ "$rc" = 0 ] && [ ! -f "$OUT/bench/roofline.png" ] && note="$note (no roofline.png: matplotlib does not import)"
  record "benchmark ($mode)" "$rc" "$note"
fi

failed=0
{
  echo
  echo "== summary: $(elapsed)s, python $python ($python_why), outputs in $OUT"
  printf '%-22s %4s  %s\n' stage rc result
  for i in "${!stage_names[@]}"; do
    printf '%-22s %4s  %s\n' "${stage_names[$i]}" "${stage_rcs[$i]}" "${stage_notes[$i]}"
    case "${stage_rcs[$i]}" in 0|-) ;; *) failed=$((failed + 1)) ;; esac
  done
  if [ "$failed" = 0 ]; then echo "suite: passed"; else echo "suite: FAILED ($failed of ${#stage_names[@]} stages)"; fi
} | tee -a "$log"
# (the count above ran in a subshell of the pipe; count again for the exit status)
for rc in "${stage_rcs[@]}"; do case "$rc" in 0|-) ;; *) exit 1 ;; esac; done
exit 0
