#!/usr/bin/env bash
# Build the asyncrl image from the repository: bash deploy/docker/build.sh cpu|cuda [TAG] [docker build args...]
#
# The context is what git knows of the work tree (tracked files and untracked ones it does not ignore), sent
# as a tar on stdin: .venv/, outputs/ and caches never travel, with BuildKit or the legacy builder alike.
#   bash deploy/docker/build.sh cpu                       # asyncrl:cpu from deploy/docker/Dockerfile.cpu
#   bash deploy/docker/build.sh cuda asyncrl:cuda --build-arg VLLM_VERSION=   # CUDA image without vLLM
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
kind="${1:-cpu}"
case "$kind" in
  cpu) dockerfile=deploy/docker/Dockerfile.cpu ;;
  cuda | gpu) dockerfile=deploy/docker/Dockerfile ;;
  *) echo "usage: $0 cpu|cuda [TAG] [docker build args...]" >&2; exit 2 ;;
esac
tag="${2:-asyncrl:$kind}"
shift $(($# < 2 ? $# : 2))
cd "$root"
git ls-files -z --cached --others --exclude-standard \
  | while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done \
  | tar --null -T - -cf - \
  | docker build -f "$dockerfile" -t "$tag" "$@" -
echo "built $tag from $dockerfile"
