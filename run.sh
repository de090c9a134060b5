#!/usr/bin/env bash
# Install everything (virtual environment, torch, qshard[dev]) and run qshard's main job.
# Extra arguments go to the job. Rerunning it replaces the earlier run in its --out
# (--overwrite; `qshard train` itself refuses to, see docs/train.md); --resume continues it.
set -euo pipefail
cd "$(dirname "$0")"
. scripts/setup-venv.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec qshard train --overwrite "$@"
