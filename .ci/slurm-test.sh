#!/usr/bin/env bash
# The Slurm test alone, on a real one-node Slurm (.ci/slurm.sh starts it and, on the way out,
# stops what it started):   bash .ci/slurm-test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
eval "$(bash .ci/slurm.sh | tail -n 1)"
trap 'bash .ci/slurm.sh stop' EXIT
python3 -m pytest -q -s -n 0 -m slurm tests/test_slurm.py "$@"
