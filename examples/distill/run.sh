#!/usr/bin/env bash
# On-policy distillation on CPU: a tiny student learns from a tiny teacher on its own samples.
#
# What it does (everything lands in outputs/distill/; ~12 minutes on 2 cores):
#   1. builds the tiny model (random init, byte tokenizer; the bench job's size) and 10k reverse-text SFT rows
#      (the bench job's task: bare 5-8 letter words);
#   2. one SFT run (examples/distill/sft.toml): the student is its weights after 250 steps, the teacher after 400;
#   3. scores both on the held-out words (`python -m asyncrl.bench.heldout`: 128 words no training stage sees,
#      exact match, greedy and sampled at T=1); measured: student 0.51, teacher 0.89 sampled;
#   4. `rl @ examples/distill/rl.toml`: rl starts the inference server (the student), the teacher server
#      ([teacher], logs/teacher.log, port 8001), orchestrator and trainer; the orchestrator asks the teacher for
#      its top 20 tokens at every position of every sampled completion (prompt logprobs, no sampling) and the
#      trainer pulls the student toward them (forward KL), beside the reward; the metrics show the teacher KL;
#   5. scores the distilled student on the same held-out words.
#
# The teacher can be any server `inference` runs (embedded or vLLM, here or on another host) with the student's
# tokenizer: drop [teacher] and set [orchestrator.teacher] base_url (+ api_key_var) to use a running one.
# RL from the reward alone, distillation and both mixed, from this same start: benchmarks/distill.py.
#
#   bash examples/distill/run.sh            # from the repository root, after scripts/setup.sh (or pip install -e .)
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -d .venv ] && export PATH="$PWD/.venv/bin:$PATH"
out=outputs/distill
rm -rf "$out"
mkdir -p "$out"
start=$(date +%s)
echo "== 1/5 tiny model + SFT data -> $out"
asyncrl-tiny-model "$out/tiny-model" --hidden-size 128 --num-layers 4 --num-heads 4 --num-kv-heads 2 \
  --intermediate-size 512 --seed 0
python -m reverse_text --sft-out "$out/sft.jsonl" --n 10000 --seed 0 --min-len 5 --max-len 8 \
  --system-prompt "Reverse the text character by character." --user-template "{text}"
echo "== 2/5 SFT, 400 steps: student = step 250, teacher = step 400 -> $out/sft"
# the loss drops sharply at a step that moves with the float reduction order: pin the threads
OMP_NUM_THREADS=1 sft @ examples/distill/sft.toml
echo "== 3/5 held-out exact match of student and teacher"
python -m asyncrl.bench.heldout "$out/sft/weights/step_250" "$out/sft/weights/step_400" 2>/dev/null
echo "== 4/5 on-policy distillation: rl @ examples/distill/rl.toml -> $out/rl"
rl @ examples/distill/rl.toml
echo "== 5/5 held-out exact match of the distilled student"
python -m asyncrl.bench.heldout "$out/rl/weights/step_100" 2>/dev/null
echo "== done in $(( $(date +%s) - start ))s; look at it: asyncrl status $out/rl, $out/rl/report.html"
