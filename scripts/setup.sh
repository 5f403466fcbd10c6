#!/usr/bin/env bash
# Create/refresh the project environment in .venv (idempotent; fast when nothing changed).
#
# `scripts/setup.sh --classic` makes .venv-classic instead: asyncrl with verifiers 0.3 (requirements/classic.lock),
# where classic environments (`load_environment`) load; scripts/test.sh runs the classic-API tests there. It holds
# no environments/* (those are verifiers v1 packages).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/installer.sh
PY=${PYTHON:-python3}
venv=.venv
lock=requirements/cpu.lock
envs=$(ls -d environments/*/ 2>/dev/null | sed 's#/$##' | while read -r d; do [ -f "$d/pyproject.toml" ] && echo "$d"; done)
if [ "${1:-}" = --classic ]; then
  venv=.venv-classic
  lock=requirements/classic.lock
  envs=
  INSTALL_BYTECODE=lazy  # scripts/installer.sh: only the classic-API tests and classic envs import from here
fi
if [ ! -x "$venv/bin/python" ]; then
  echo "[setup] creating $venv with $($PY --version)"
  "$PY" -m venv "$venv"
fi
# Install torch first, pinned: an unpinned torch makes pip fetch a multi-GB CUDA build. On a GPU
# machine install the CUDA build you want into .venv before running this; it is kept.
if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
  echo "[setup] installing torch==2.13.0"
  install_into "$venv" torch==2.13.0
fi
stamp=$venv/.asyncrl-setup
want=$(cat pyproject.toml "$lock" $(for d in $envs; do echo "$d/pyproject.toml"; done) | sha1sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing asyncrl and environments into $venv: $envs"
  # the lock pins every dependency (scripts/lock.sh re-writes it); torch is installed above
  args=(-r "$lock" -e ".[dev]")
  for d in $envs; do args+=(-e "$d"); done
  install_into "$venv" "${args[@]}"
  # verifiers 0.3 installs a console script named `eval` too: the one in bin/ must be ours
  grep -q "asyncrl.entrypoints.eval" "$venv/bin/eval" || install_into "$venv" --no-deps --force-reinstall -e .
  echo "$want" > "$stamp"
fi
