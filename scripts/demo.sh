#!/usr/bin/env bash
# Set up .venv and run the CPU demo: build a tiny model locally and resolve the demo's config.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
out=${OUTPUT_DIR:-outputs/demo}
.venv/bin/asyncrl-tiny-model "$out/tiny-model"
.venv/bin/rl @ examples/reverse_text/rl.toml --model.name "$out/tiny-model" --output-dir "$out" --dry-run
