# Sourced by the launchers (scripts/bench, bench_binned, tune, demo, gpu_suite.sh). Sets
#   root        the repository
#   python      $PYTHON, else the project's .venv, else python3
#   PYTHONPATH  the folders whose modules the scripts import by name (tests/conftest.py puts the same folders on
#               sys.path for the tests; no Python file edits sys.path):
#                 scripts/     the benchmark and release tooling (bench, _bench_ceilings, _hub_release, ...)
#                 benchmarks/  float64 references, tolerance table, MODEL_SHAPES (shipped with the Hub benchmark)
#                 torch-ext/   the moe_dispatch package
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-}"
if [ -z "$python" ]; then
  if [ -x "$root/.venv/bin/python" ]; then python="$root/.venv/bin/python"; else python=python3; fi
fi
export PYTHONPATH="$root/scripts:$root/benchmarks:$root/torch-ext${PYTHONPATH:+:$PYTHONPATH}"
