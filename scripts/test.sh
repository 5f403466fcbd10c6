#!/usr/bin/env bash
# Set up .venv and run the test suite (pass pytest args to narrow it, e.g. -m "not slow").
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
