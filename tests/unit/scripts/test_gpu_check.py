"""`scripts/gpu_check.sh` on a machine without CUDA: says so, prints what each check would run, resolves every
asyncrl command line with its `--dry-run`, prints the table (and writes it to --out) and exits 0; a broken flag
fails the dry check. The vLLM rows say why they cannot run on the lent machine."""

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
CHECKS = [
    "imports",
    "cuda",
    "fsdp2_nccl",
    "shared_prefix_cuda_attention",
    "engine_logprobs_vs_trainer",
    "engine_cuda_throughput",
    "bench_qwen3_0.6b_16k",
    "bench_qwen3_0.6b_16k_ac",
    "rl_single_gpu_shared_prefix",
    "rl_multi_run_lora",
    "multi_run_batched_trainer",
    "rl_distill_teacher",
    "rl_moe_router_replay",
]
VLLM = ["vllm_update_weights", "rl_multi_run_lora_vllm"]
pytestmark = pytest.mark.slow  # each dry check resolves ~20 command lines, one process each (~30 s)


def gpu_check(*args: str, **env: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", **env}
    return subprocess.run(["bash", "scripts/gpu_check.sh", *args], cwd=REPO, capture_output=True, text=True, env=env)


def rows(out: str) -> dict[str, str]:
    table = [line.split(" | ") for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    return {r[0].lstrip("| "): r[1] for r in table[1:]}


def test_dry_check_on_a_cpu_machine(tmp_path):
    done = gpu_check("--out", str(tmp_path))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.startswith("no CUDA GPU here: dry check only")
    assert rows(done.stdout) == dict.fromkeys(CHECKS, "dry") | dict.fromkeys(VLLM, "skipped")
    assert "--trainer-gpu-ids [0]" in done.stdout and "'seq_len': 16384" in done.stdout
    table = (tmp_path / "gpu_check.md").read_text()
    assert table.startswith("device: none (dry)") and rows(table) == rows(done.stdout)


def test_a_broken_command_fails_the_dry_check():
    only = "fsdp2_nccl,bench_qwen3_0.6b_16k,rl_single_gpu_shared_prefix"  # two rows pass the flag, one does not
    done = gpu_check("--only", only, GPU_CHECK_EXTRA_TRAINER_ARGS="--no-such-flag")
    assert done.returncode == 1
    got = rows(done.stdout)
    assert set(got) == set(only.split(","))
    assert got["fsdp2_nccl"] == got["bench_qwen3_0.6b_16k"] == "FAIL" and got["rl_single_gpu_shared_prefix"] == "dry"
    assert "no-such-flag" in done.stdout
