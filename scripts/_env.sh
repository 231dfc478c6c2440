# Sourced by the launchers (scripts/bench, bench_binned, tune, demo, gpu_suite.sh). Sets
#   root        the repository
#   python      $PYTHON, else the project's .venv, else python3
#   PYTHONPATH  the folders whose modules the scripts import by name (pytest.ini's pythonpath gives the tests the
#               same folders; no Python file edits sys.path):
#                 scripts/     the benchmark and release tooling (harness, bench, tune, _hub_release, ...)
#                 benchmarks/  MODEL_SHAPES and the Hub benchmark (shipped with it)
#                 torch-ext/   the moe_dispatch package, with its float64 references (moe_dispatch.reference)
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-}"
if [ -z "$python" ]; then
  if [ -x "$root/.venv/bin/python" ]; then python="$root/.venv/bin/python"; else python=python3; fi
fi
export PYTHONPATH="$root/scripts:$root/benchmarks:$root/torch-ext${PYTHONPATH:+:$PYTHONPATH}"
