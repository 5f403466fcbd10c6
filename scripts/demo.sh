#!/usr/bin/env bash
# The CPU demo, from a fresh clone: set up .venv, build a tiny model locally, SFT-warm it on
# reverse-text, then RL it with `rl` (inference + orchestrator + trainer, async level 1).
# Prints the reward per step and a summary; ~3 minutes on 2 cores. Everything lands in outputs/demo/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
out=outputs/demo
rm -rf "$out"
mkdir -p "$out"
start=$(date +%s)
echo "== 1/3 tiny model (random init, byte tokenizer) -> $out/tiny-model"
asyncrl-tiny-model "$out/tiny-model"
echo "== 2/3 SFT warm-up on 10k generated reverse-text examples -> $out/sft"
python -m reverse_text --sft-out "$out/reverse_sft.jsonl" --n 10000
OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} sft @ examples/reverse_text/sft.toml --max-steps 150
echo "== 3/3 RL on reverse-text from $out/sft/weights/step_150 -> $out/rl"
rl @ examples/reverse_text/rl.toml
echo "== demo done in $(( $(date +%s) - start ))s; look at it: asyncrl status outputs/demo/rl, outputs/demo/rl/report.html"
