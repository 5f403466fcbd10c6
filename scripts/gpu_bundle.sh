#!/usr/bin/env bash
# Make the wheel bundle for the lent GPU machine (no network there; Python 3.12, torch 2.11 in its image):
# exactly the packages in scripts/gpu_bundle.lock, cp312 manylinux x86_64, --no-deps, into .gpu_bundle/.
# Fails if the bundle plus the working tree would not fit the 64 MiB a device call carries.
# Then: run(command="bash scripts/gpu_check.sh", carry=[".gpu_bundle"], timeout_s=540)  (docs/development.md)
set -euo pipefail
cd "$(dirname "$0")/.."
out=.gpu_bundle
rm -rf "$out.tmp" && mkdir -p "$out.tmp"
platforms=()
for p in manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux1; do platforms+=(--platform "${p}_x86_64"); done
grep -v -e '^#' -e '^$' scripts/gpu_bundle.lock > "$out.tmp/requirements.txt"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
  -d "$out.tmp" -r "$out.tmp/requirements.txt" 2> >(grep -v "is ignored: it is neither" >&2)
rm -f "$out.tmp/requirements.txt"
wheels=$(find "$out.tmp" -name '*.whl' | wc -l)
wanted=$(grep -c -v -e '^#' -e '^$' scripts/gpu_bundle.lock)
[ "$wheels" -eq "$wanted" ] || { echo "gpu_bundle: $wheels wheels for $wanted locked packages" >&2; exit 1; }
rm -rf "$out" && mv "$out.tmp" "$out"
bundle=$(du -sb "$out" | cut -f1)
tree=$(git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
limit=$((64 * 1024 * 1024))
printf 'gpu_bundle: %d wheels, %.1f MiB; with the working tree (%.1f MiB) %.1f of 64 MiB\n' "$wheels" \
  "$(echo "$bundle / 1048576" | bc -l)" "$(echo "$tree / 1048576" | bc -l)" "$(echo "($bundle + $tree) / 1048576" | bc -l)"
[ $((bundle + tree)) -lt $limit ] || { echo "gpu_bundle: too big for one device call (64 MiB)" >&2; exit 1; }
