#!/usr/bin/env bash
# PRIME-RL's scripts/install.sh (its quick installation), here: set up asyncrl in .venv from this checkout.
#
# It ends in the same .venv as scripts/setup.sh, which it runs: a Python venv, torch==2.13.0 (or the CUDA
# torch already in .venv), the locked dependencies, asyncrl[dev] and environments/* editable. PRIME-RL's
# script also clones the repository and installs uv; here run it from a clone (uv is put into .venv by
# scripts/installer.sh where it can be had). `--fa` also builds flash-attention into .venv (PRIME-RL's
# `uv sync --extra fa`): CUDA only, so it stops first, with one line, where no CUDA toolkit is found.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! grep -qs '^name = "asyncrl"' pyproject.toml; then
  echo "error: scripts/install.sh sets up a clone of asyncrl: git clone <asyncrl repo> && cd asyncrl && bash scripts/install.sh" >&2
  exit 2
fi
fa=0
for arg in "$@"; do
  case "$arg" in
    --fa) fa=1 ;;
    *) echo "error: unknown option $arg (scripts/install.sh [--fa])" >&2; exit 2 ;;
  esac
done
# flash-attn compiles against .venv's torch: that must be a CUDA build, installed before (README), and nvcc there
cuda_torch() { .venv/bin/python -c "import torch, sys; sys.exit(torch.version.cuda is None)" 2>/dev/null; }
if [ "$fa" = 1 ] && ! { cuda_torch && { command -v nvcc >/dev/null || [ -x "${CUDA_HOME:-/none}/bin/nvcc" ]; }; }; then
  echo "error: --fa builds flash-attn, which needs CUDA: a CUDA torch in .venv and nvcc (install them first; see docs/development.md); nothing was installed" >&2
  exit 2
fi
bash scripts/setup.sh
if [ "$fa" = 1 ]; then
  source scripts/installer.sh
  echo "[install] building flash-attn against .venv's torch (can take a long time; MAX_JOBS limits the compile jobs)"
  install_into .venv --no-build-isolation "flash-attn>=2.8"
fi
echo "[install] done: source .venv/bin/activate"
