#!/usr/bin/env bash
# Install everything (virtual environment, torch, qshard[dev]) and run the test suite:
# lint, format check, then pytest. Extra arguments go to pytest.
#   ./test.sh                  # the default suite (what CI runs)
#   ./test.sh --slow           # also the tests marked slow
#   ./test.sh tests/quant -k int4
set -euo pipefail
cd "$(dirname "$0")"
. scripts/setup-venv.sh

marker=(-m "not slow")
args=()
for a in "$@"; do
    if [ "$a" = "--slow" ]; then marker=(-m ""); else args+=("$a"); fi
done

echo "[test] ruff check"
ruff check .
echo "[test] ruff format --check"
ruff format --check .
echo "[test] pytest"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
set +e
python -m pytest "${marker[@]}" "${args[@]}"
rc=$?
set -e
# pytest exits 5 when a selection collects no test: not a failure of the suite.
if [ "$rc" -eq 5 ]; then
    echo "[test] no tests collected"
    rc=0
fi
exit "$rc"
