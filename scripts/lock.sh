#!/usr/bin/env bash
# Re-write requirements/cpu.lock (run after changing a dependency in pyproject.toml or environments/*).
# Resolves asyncrl[dev] + every environment with pip-tools, pip's own index settings, torch pinned and left out.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
tools=$(mktemp -d)
python3 -m venv "$tools" && "$tools/bin/pip" install -q pip-tools
in="$tools/lock.in"
echo "-e file://$root#egg=asyncrl[dev]" > "$in"
for d in environments/*/; do [ -f "$d/pyproject.toml" ] && echo "-e file://$root/${d%/}" >> "$in"; done
echo "torch==2.13.0" >> "$in"
"$tools/bin/pip-compile" -q --no-header --strip-extras --unsafe-package torch --no-emit-index-url \
  --no-emit-find-links -o "$tools/out.txt" "$in"
{
  echo "# The CPU setup's locked dependencies (asyncrl[dev] + environments/*), written by scripts/lock.sh."
  echo "# torch is left out on purpose: setup installs torch==2.13.0 (CPU) first, or keeps the CUDA build you installed."
  # our own editable packages are installed by setup.sh, not pinned here
  awk '/^-e /{skip=1; next} skip && /^    #/{next} {skip=0; gsub(/\/[^ ]*lock\.in/, "scripts/lock.sh"); print}' "$tools/out.txt"
} > requirements/cpu.lock
rm -rf "$tools"
echo "wrote requirements/cpu.lock ($(grep -c '==' requirements/cpu.lock) pins)"
