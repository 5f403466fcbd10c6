"""The GPU acceptance run: everything the CPU test suite cannot check, on a CUDA machine, as one table.

Checks: the GPU itself; FSDP2 over NCCL (torchrun'd `trainer --bench`, up to 2 ranks); `trainer --bench`
at Qwen3-0.6B's shape (random init, built here) and seq_len 16384, with MFU; the vLLM backend on the GPU
with `/update_weights` (the served answer changes); a single-GPU `rl` run (inference and trainer sharing
GPU 0) whose reward rises, with shared-prefix training on the CUDA attention path; two `[[runs]]` LoRA
runs on one trainer with vLLM serving both adapters (it reuses the rl check's SFT model). Without CUDA it
says so, prints each command, checks every asyncrl command line with the entrypoint's own `--dry-run`, and
exits 0 unless one of them is broken. Run it as `bash scripts/gpu_check.sh`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
ENTRY = "asyncrl.entrypoints."
ONE_GPU = ["--inference-gpu-ids", "[0]", "--trainer-gpu-ids", "[0]", "--inference.gpu-memory-utilization", "0.3"]
EXTRA = os.environ.get("GPU_CHECK_EXTRA_TRAINER_ARGS", "").split()  # e.g. a broken flag, to see the check fail


@dataclass
class Check:
    name: str
    commands: Callable[[Path], list[list[str]]]  # what it runs, from the work dir
    judge: Callable[[Path, list[str]], str]  # its key number from the outputs; raises AssertionError on failure
    needs_vllm: bool = False


def bench_line(_: Path, outputs: list[str]) -> str:
    found = re.findall(r"bench \| tokens/s ([\d,]+) \| MFU ([^|]+)\|", outputs[-1])
    assert found, "no bench line in the output"
    return f"{found[-1][0]} tok/s, MFU {found[-1][1].strip()}"


def trainer_bench(model: str, ranks: int, seq_len: int) -> list[str]:
    run = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), "-m"]
    fake = f"{{'micro_batch_size': 1, 'batch_size': {4 * ranks}, 'seq_len': {seq_len}}}"
    return run + [ENTRY + "trainer", "--model.name", model, "--bench", "--device", "cuda", "--data.fake", fake, *EXTRA]


def gpus() -> int:
    import torch

    return torch.cuda.device_count()


def served_answers_differ(work: Path, outputs: list[str]) -> str:
    answers = json.loads(outputs[-1])
    assert answers["before"] != answers["after"], f"same answer after /update_weights: {answers}"
    return f"{answers['seconds']:.1f}s to update; answer changed"


def reward_rises(work: Path, _: list[str]) -> str:
    rows = [json.loads(x) for x in (work / "rl" / "metrics" / "orchestrator.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("kind", "train") == "train"]
    early, late = (sum(r["reward/mean"] for r in part) / len(part) for part in (rows[:5], rows[-5:]))
    shared = max(r.get("batch/shared_frac", 0.0) for r in rows)
    assert late > early + 0.02, f"reward {early:.3f} -> {late:.3f}"
    assert shared > 0, "no shared-prefix tokens were trained"
    return f"reward {early:.3f} -> {late:.3f}, shared prefix {shared:.0%} of tokens"


def runs_train_on_vllm(work: Path, _: list[str]) -> str:
    said = []
    for name in ("reverse", "echo"):
        run = work / "multi" / f"run_{name}"
        status = json.loads((run / "run_status.json").read_text())
        assert status["state"] == "done", f"run {name}: {status}"
        rows = [json.loads(x) for x in (run / "metrics" / "trainer.jsonl").read_text().splitlines()]
        kl = sorted(r["mismatch_kl"] for r in rows)[len(rows) // 2]
        assert kl < 0.05, f"run {name}: median mismatch KL {kl:.3g} (is vLLM serving the run's adapter?)"
        said.append(f"{name} {len(rows)} steps, mismatch KL {kl:.1e}")
    return "; ".join(said)


VLLM_PROBE = r"""
import json, sys, time, httpx
url, base, other = sys.argv[1:4]
ask = lambda: httpx.post(url + "/v1/chat/completions", timeout=120, json={"model": base, "max_tokens": 12,
    "temperature": 0, "messages": [{"role": "user", "content": "Reverse the text: gpu"}]}).json()["choices"][0]
before = ask()["message"]["content"]
t = time.time()
httpx.post(url + "/update_weights", json={"weight_dir": other}, timeout=600).raise_for_status()
print(json.dumps({"before": before, "after": ask()["message"]["content"], "seconds": time.time() - t}))
"""

CHECKS = [
    Check(
        "cuda",
        lambda w: [
            [PY, "-c", "import torch; print(torch.cuda.get_device_name(0), torch.__version__, torch.version.cuda)"]
        ],
        lambda w, out: out[-1].strip(),
    ),
    Check(
        "fsdp2_nccl",
        lambda w: [trainer_bench(str(w / "tiny"), max(1, min(2, gpus())), 2048)],
        bench_line,
    ),
    Check(
        "bench_qwen3_0.6b_16k",
        lambda w: [
            [
                PY,
                "-c",
                f"from asyncrl.utils.tiny_model import build_tiny_model as b; b('{w / 'qwen3-0.6b'}', "
                "hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128, intermediate_size=3072, "
                "vocab_size=151936, max_position_embeddings=40960)",
            ],
            trainer_bench(str(w / "qwen3-0.6b"), 1, 16384) + ["--model.optimization-dtype", "bfloat16"],
        ],
        bench_line,
    ),  # fmt: skip
    Check(
        "vllm_update_weights",
        lambda w: [
            [
                "SERVE",
                PY,
                "-m",
                ENTRY + "inference",
                "--backend",
                "vllm",
                "--model.name",
                str(w / "tiny"),
                "--server.port",
                "8011",
                "--gpu-memory-utilization",
                "0.3",
                "--output-dir",
                str(w / "vllm"),
            ],
            [PY, "-c", VLLM_PROBE, "http://127.0.0.1:8011", str(w / "tiny"), str(w / "tiny-other")],
        ],
        served_answers_differ,
        needs_vllm=True,
    ),  # fmt: skip
    Check(
        "rl_single_gpu_shared_prefix",
        lambda w: [
            [PY, "-m", "reverse_text", "--sft-out", str(w / "sft.jsonl"), "--n", "10000"],
            [
                PY,
                "-m",
                ENTRY + "sft",
                "@",
                "examples/reverse_text/sft.toml",
                "--model.name",
                str(w / "tiny"),
                "--data.name",
                str(w / "sft.jsonl"),
                "--output-dir",
                str(w / "sft"),
                "--max-steps",
                "150",
            ],
            [
                PY,
                "-m",
                ENTRY + "rl",
                "@",
                "examples/reverse_text/rl.toml",
                "--model.name",
                str(w / "sft" / "weights" / "step_150"),
                "--output-dir",
                str(w / "rl"),
                "--max-steps",
                "40",
                *ONE_GPU,
            ],
        ],
        reward_rises,
    ),  # fmt: skip
    Check(
        "rl_multi_run_lora_vllm",
        lambda w: [
            [
                PY,
                "-m",
                ENTRY + "rl",
                "@",
                "examples/multi_run/rl.toml",
                "--model.name",
                str(w / "sft" / "weights" / "step_150"),
                "--output-dir",
                str(w / "multi"),
                "--max-steps",
                "20",
                "--inference.backend",
                "vllm",
                *ONE_GPU,
            ],
        ],
        runs_train_on_vllm,
        needs_vllm=True,
    ),  # fmt: skip
]


def run(cmd: list[str], log: Path) -> str:
    """Run one command (a `SERVE` one in the background, waited for on /health); its output."""
    if cmd[0] == "SERVE":
        from asyncrl.utils.process import spawn, wait_for_http

        proc = spawn(cmd[1:], log)
        SERVERS.append(proc)
        wait_for_http("http://127.0.0.1:8011/health", 900, proc, log)
        return ""
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    log.write_text(done.stdout + done.stderr)
    if done.returncode:
        raise AssertionError(f"exit {done.returncode}: {(done.stdout + done.stderr).strip().splitlines()[-1:]}")
    return done.stdout


SERVERS: list = []


def on_gpu(check: Check, work: Path) -> tuple[str, str]:
    if check.needs_vllm and subprocess.run([PY, "-c", "import asyncrl.inference.vllm.launch as m; "
                                            "assert m.vllm_python()"], capture_output=True).returncode:  # fmt: skip
        return "skipped", "no vLLM env (scripts/install_vllm.sh; a CUDA vLLM for the GPU)"
    try:
        outputs = [run(cmd, work / f"{check.name}.{i}.log") for i, cmd in enumerate(check.commands(work))]
        return "pass", check.judge(work, outputs)
    except AssertionError as e:
        for log in sorted(work.glob(f"{check.name}.*.log")):  # what went wrong, before the table
            print(f"  -- tail of {log.name}:", *log.read_text().splitlines()[-15:], sep="\n  ")
        return "FAIL", str(e)[:200]
    finally:
        from asyncrl.utils.process import stop_groups

        stop_groups(SERVERS)
        SERVERS.clear()


def dry(check: Check, work: Path) -> tuple[str, str]:
    """Print the commands; each asyncrl entrypoint's line must pass its own --dry-run."""
    for cmd in check.commands(work):
        cmd = cmd[1:] if cmd[0] == "SERVE" else cmd
        print("  $", " ".join(a if "\n" not in a else "<script>" for a in cmd))
        module = next((a for a in cmd if a.startswith(ENTRY)), None)
        if module is None:
            continue
        args = cmd[cmd.index(module) + 1 :]
        done = subprocess.run([PY, "-m", module, *args, "--dry-run"], cwd=REPO, capture_output=True, text=True)
        if done.returncode:
            return "FAIL", f"{module} rejects its flags: {done.stderr.strip().splitlines()[-1]}"
    return "dry", "flags resolve (--dry-run)"


def main() -> int:
    import torch

    cuda = torch.cuda.is_available()
    print("GPU acceptance run" if cuda else "no CUDA GPU here: dry check only (the commands each check would run)")
    rows = []
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        work = Path(tmp)
        if cuda:
            from asyncrl.utils.tiny_model import build_tiny_model

            build_tiny_model(work / "tiny", hidden_size=128, num_layers=4)  # vLLM's GPU attention: head_dim 32
            build_tiny_model(work / "tiny-other", hidden_size=128, num_layers=4, seed=1)
        for check in CHECKS:
            print(f"== {check.name}", flush=True)
            start = time.monotonic()
            status, result = (on_gpu if cuda else dry)(check, work)
            rows.append((check.name, status, time.monotonic() - start, result))
            print(f"  {status}: {result} ({rows[-1][2]:.0f}s)", flush=True)
    print("\n| check | status | seconds | result |\n|---|---|---|---|")
    for name, status, seconds, result in rows:
        print(f"| {name} | {status} | {seconds:.0f} | {result} |")
    return 1 if any(status == "FAIL" for _, status, _, _ in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
