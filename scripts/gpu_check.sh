#!/usr/bin/env bash
# The GPU acceptance run (scripts/gpu_check.py): on a CUDA machine, FSDP2 over NCCL, trainer --bench at
# Qwen3-0.6B's shape and 16k tokens (MFU), vLLM on the GPU with /update_weights, and a single-GPU rl run
# with shared-prefix training; one table. Without CUDA: a dry check of every command, exit 0 if all resolve.
set -uo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh || exit 1
exec .venv/bin/python scripts/gpu_check.py "$@"
