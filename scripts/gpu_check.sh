#!/usr/bin/env bash
# The GPU acceptance run (scripts/gpu_check.py): one table of what only a CUDA machine can check.
# With .venv (a dev machine): runs in it; without CUDA that is a dry walk of every row.
# With --bundle, or on a machine with no .venv but a .gpu_bundle/ (the lent GPU machine: Python 3.12 and
# torch 2.11 in its image, no network): installs the wheels of scripts/gpu_bundle.sh into a target dir
# and runs with the image's python3 (GPU_CHECK_PYTHON to name another). Other flags go to gpu_check.py.
set -uo pipefail
cd "$(dirname "$0")/.."
bundle=0
args=()
for a in "$@"; do [ "$a" = --bundle ] && bundle=1 || args+=("$a"); done
[ ! -x .venv/bin/python ] && [ -d .gpu_bundle ] && bundle=1
if [ "$bundle" = 1 ]; then
  py=${GPU_CHECK_PYTHON:-python3}
  site=${TMPDIR:-/tmp}/asyncrl-gpu-site
  [ -d .gpu_bundle ] || { echo "gpu_check: no .gpu_bundle/ here; make it with: bash scripts/gpu_bundle.sh" >&2; exit 2; }
  rm -rf "$site"
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
    --target "$site" .gpu_bundle/*.whl || { echo "gpu_check: installing .gpu_bundle failed" >&2; exit 2; }
  envs=$(printf '%s:' "$PWD"/environments/*/)
  export PYTHONPATH="$site:$PWD/src:$envs${PYTHONPATH:-}"
  export PATH="$site/bin:$PATH"
else
  [ -x .venv/bin/python ] || bash scripts/setup.sh || exit 1
  py=.venv/bin/python
fi
export PYTHONUNBUFFERED=1
exec "$py" scripts/gpu_check.py "${args[@]}"
