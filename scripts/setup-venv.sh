# Sourced by ./run.sh and ./test.sh: create the virtual environment and install qshard into it.
# On this project's CPU machines `pip install torch==2.13.0` takes a local CPU build; any range
# that admits a newer torch would pull a multi-GB CUDA build, so torch is installed first, pinned,
# when the environment has none. QSHARD_VENV overrides the location (default: .venv).
QSHARD_VENV="${QSHARD_VENV:-.venv}"
if [ ! -x "$QSHARD_VENV/bin/python" ]; then
    echo "[setup] creating virtual environment in $QSHARD_VENV"
    python3 -m venv "$QSHARD_VENV"
fi
# shellcheck disable=SC1091
. "$QSHARD_VENV/bin/activate"
if ! python -c "import torch" >/dev/null 2>&1; then
    echo "[setup] installing torch==2.13.0"
    python -m pip install --quiet --disable-pip-version-check torch==2.13.0
fi
echo "[setup] installing qshard[dev] (editable)"
python -m pip install --quiet --disable-pip-version-check -e ".[dev]"
