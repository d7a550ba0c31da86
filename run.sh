#!/usr/bin/env bash
# One entry point that sets everything up on a fresh machine and then runs a job.
#   ./run.sh demo [options]   export the default decoder stack, validate it, time FP32 vs INT4
#   ./run.sh test [pytest args]   the test suite
#   ./run.sh bench [options]  the benchmark table (see docs/benchmarks.md)
# Set-up: a virtualenv in .venv (or $CIM_INT4_VENV) with this package installed from the
# source tree (CMake builds the op library; ORT headers are fetched if none are found).
set -euo pipefail
cd "$(dirname "$0")"
job=${1:-demo}
shift || true

venv=${CIM_INT4_VENV:-.venv}
python=${PYTHON:-python3}
if [ ! -x "$venv/bin/python" ]; then
    echo "run.sh: creating virtualenv $venv" >&2
    "$python" -m venv "$venv"
fi
echo "run.sh: installing cim-int4 and its test/bench/serve dependencies into $venv" >&2
"$venv/bin/python" -m pip install -q --disable-pip-version-check ".[test,bench,serve]" >&2

case "$job" in
    demo) exec "$venv/bin/cim-int4" demo "$@" ;;
    bench) exec "$venv/bin/cim-int4" bench "$@" ;;
    test) exec "$venv/bin/python" -m pytest "$@" ;;
    *) echo "usage: ./run.sh demo|test|bench [args]" >&2; exit 2 ;;
esac
