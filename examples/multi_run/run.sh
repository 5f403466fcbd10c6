#!/usr/bin/env bash
# Two RL runs on one trainer and one inference server, on CPU: a tiny model, an SFT warm-up on both tasks
# (reverse-text, echo-twice), then `rl @ examples/multi_run/rl.toml` (one LoRA adapter per run).
# Everything lands in outputs/multi_run/; each run in outputs/multi_run/rl/run_NAME/.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -x .venv/bin/python ] || bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
out=outputs/multi_run
rm -rf "$out"
mkdir -p "$out"
echo "== 1/3 tiny model -> $out/tiny-model"
asyncrl-tiny-model "$out/tiny-model"
echo "== 2/3 SFT warm-up on reverse-text + echo-twice -> $out/sft"
python -m reverse_text --sft-out "$out/reverse.jsonl" --n 10000
python -m echo_twice --sft-out "$out/echo.jsonl" --n 4000
cat "$out/reverse.jsonl" "$out/echo.jsonl" > "$out/sft.jsonl"
OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} sft @ examples/multi_run/sft.toml
echo "== 3/3 two RL runs at once -> $out/rl/run_reverse, $out/rl/run_echo"
rl @ examples/multi_run/rl.toml
