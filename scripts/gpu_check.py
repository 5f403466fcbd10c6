"""The GPU acceptance run: everything the CPU test suite cannot check, on a CUDA machine, as one table.

Rows, each printed as it finishes: the packages import; FSDP2 over NCCL (torchrun'd `trainer --bench`);
shared-prefix training on the CUDA attention kernels (the unit test's equal logprobs/loss/gradients vs
the expanded rows); the embedded engine on CUDA, its logprobs against the trainer's recomputation and
its throughput at 64/128/256 concurrent requests; `trainer --bench` at Qwen3-0.6B's shape (random
init, built here) and 16k tokens, with MFU; a single-GPU `rl` run (engine and trainer sharing GPU 0)
whose reward rises; two `[[runs]]` LoRA runs on one trainer; the multi-run trainer's run-steps/s with 4 and 8
runs trained together next to 1 (benchmarks/multi_run.py); `rl` with a `[teacher]` server on the same GPU
(on-policy distillation: the teacher's prompt logprobs on CUDA). vLLM rows say why they did not run.

The rows keep to `--budget` seconds in all (default 480): each has its own time limit, cut to what is
left, and once under 30 s are left the rest are reported "not run" rather than started. The table is printed and
written to `$OUT/gpu_check.md` (or `--out`), the failing rows' log tails to `gpu_check.log` beside it.
Without CUDA (or with `--dry`) it walks every row: prints its commands, checks each asyncrl command
line with the entrypoint's own `--dry-run`, compiles the inline scripts, collects the tests, and exits
0 unless one is broken. Run it as `bash scripts/gpu_check.sh` (docs/development.md).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
ENTRY = "asyncrl.entrypoints."
ONE_GPU = ["--inference-gpu-ids", "[0]", "--trainer-gpu-ids", "[0]", "--inference.gpu-memory-utilization", "0.3"]
EXTRA = os.environ.get("GPU_CHECK_EXTRA_TRAINER_ARGS", "").split()  # e.g. a broken flag, to see the check fail
PORT = 8011
MIN_SECONDS = 30  # a row is not started with less of the budget left
SHARED_PREFIX_TEST = Path("tests/unit/trainer/test_shared_prefix.py")
NO_VLLM = "not run: vLLM cannot be carried to the lent machine (its wheels are far over a call's 64 MiB)"


@dataclass
class Check:
    name: str
    commands: Callable[[Path], list[list[str]]]  # what it runs, from the repo root; "SERVE" first: in background
    judge: Callable[[Path, list[str]], str]  # its key number from the outputs; raises AssertionError on failure
    seconds: int = 120  # its time limit
    needs: list[str] = field(default_factory=list)  # rows that must have passed first
    skip: str = ""  # why it never runs here


def last_line(_: Path, outputs: list[str]) -> str:
    return outputs[-1].strip().splitlines()[-1]


def bench_line(_: Path, outputs: list[str]) -> str:
    found = re.findall(r"bench \| tokens/s ([\d,]+) \| MFU ([^|]+)\|", outputs[-1])
    assert found, "no bench line in the output"
    peak = re.findall(r"peak memory ([\d.]+ GiB)", outputs[-1])
    return f"{found[-1][0]} tok/s, MFU {found[-1][1].strip()}" + (f", peak memory {peak[-1]}" if peak else "")


def qwen3_06b(w: Path) -> list[str]:
    """Build the random-init Qwen3-0.6B-shaped model in `w` unless a row before did."""
    out = w / "qwen3-0.6b"
    build = f"from asyncrl.utils.tiny_model import build_tiny_model; build_tiny_model('{out}', {QWEN3_06B})"
    return [PY, "-c", f"import os; os.path.exists('{out / 'config.json'}') or exec({build!r})"]


def trainer_bench(model: str, seq_len: int, *extra: str) -> list[str]:
    run = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "-m", ENTRY + "trainer"]
    fake = f"{{'samples_per_row': 1, 'batch_size': 4, 'seq_len': {seq_len}}}"
    one_row = ["--data.micro-batch-size", "1"]  # one 16k row per forward (data.micro_batch_tokens does so too)
    return run + ["--model.name", model, "--bench", "--device", "cuda", "--data.fake", fake, *one_row, *extra, *EXTRA]


def tests_pass(_: Path, outputs: list[str]) -> str:
    summary = outputs[-1].strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary, summary
    return summary.strip("= ")


def throughput(_: Path, outputs: list[str]) -> str:
    auto, fp32 = (re.findall(r"^\| embedded \| (\d+) \| (\d+) \|", out, re.M) for out in outputs)
    assert auto and fp32, "no throughput table in the output"
    said = ", ".join(f"c={c}: {int(tps):,} tok/s" for c, tps in auto)
    return f"dtype auto (float16): {said}; float32: c={fp32[0][0]}: {int(fp32[0][1]):,} tok/s"


def logprobs_match(_: Path, outputs: list[str]) -> str:
    got = json.loads(outputs[-1].strip().splitlines()[-1])
    assert got["same_tokens"], "the trainer scored other tokens than the engine returned"
    assert got["max_abs"] < 1e-3, f"engine vs trainer logprobs differ by up to {got['max_abs']:.2e}"
    return f"{got['tokens']} tokens, max abs Δlogprob {got['max_abs']:.1e}, mean {got['mean_abs']:.1e} ({got['dtype']})"


def reward_rises(work: Path, _: list[str]) -> str:
    rows = [json.loads(x) for x in (work / "rl" / "metrics" / "orchestrator.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("kind", "train") == "train"]
    early, late = (sum(r["reward/mean"] for r in part) / len(part) for part in (rows[:5], rows[-5:]))
    shared = max(r.get("batch/shared_frac", 0.0) for r in rows)
    trainer = [json.loads(x) for x in (work / "rl" / "metrics" / "trainer.jsonl").read_text().splitlines()]
    assert late > early + 0.02, f"reward {early:.3f} -> {late:.3f}"
    assert shared > 0, "no shared-prefix tokens were trained"
    return (f"{len(rows)} steps, reward {early:.3f} -> {late:.3f}, shared prefix {shared:.0%} of tokens, "
            f"step-0 mismatch KL {trainer[0]['mismatch_kl']:.1e}")  # fmt: skip


def runs_train(work: Path, _: list[str]) -> str:
    said = []
    for name in ("reverse", "echo"):
        run = work / "multi" / f"run_{name}"
        status = json.loads((run / "run_status.json").read_text())
        assert status["state"] == "done", f"run {name}: {status}"
        rows = [json.loads(x) for x in (run / "metrics" / "trainer.jsonl").read_text().splitlines()]
        kl = sorted(r["mismatch_kl"] for r in rows)[len(rows) // 2]
        assert kl < 0.05, f"run {name}: median mismatch KL {kl:.3g} (is the engine serving the run's adapter?)"
        said.append(f"{name} {len(rows)} steps, mismatch KL {kl:.1e}")
    return "; ".join(said)


def moe_replay(work: Path, _: list[str]) -> str:
    """The tiny MoE's mismatch KL at step 0 and over the run, replay off and on; replay must agree on every route."""
    said = []
    for mode in ("off", "on"):
        rows = [json.loads(x) for x in (work / f"moe_{mode}" / "metrics" / "trainer.jsonl").read_text().splitlines()]
        kl = [r["mismatch_kl"] for r in rows if "mismatch_kl" in r]
        assert len(kl) == 10, f"replay {mode}: {len(kl)} of 10 steps trained"
        agree = [r["moe/replay_agreement"] for r in rows if "moe/replay_agreement" in r]
        assert mode == "off" or agree, f"replay on: no moe/replay_agreement in the trainer's rows ({sorted(rows[0])})"
        extra = f", agreement min {min(agree):.3f}" if agree else ""
        said.append(f"replay {mode}: mismatch KL step 0 {kl[0]:.2e}, mean {sum(kl) / len(kl):.2e}{extra}")
    return "; ".join(said)


def moe_rl(work: Path, mode: str) -> list[str]:
    """`rl` of the demo's RL config on the tiny MoE for 10 steps, routing replay `mode` (on / off)."""
    replay = ["--trainer.model.router-replay"] if mode == "on" else []
    return [PY, "-m", ENTRY + "rl", "@", "examples/reverse_text/rl.toml", "--model.name", str(work / "moe"),
            "--output-dir", str(work / f"moe_{mode}"), "--max-steps", "10", *ONE_GPU, *replay]  # fmt: skip


def runs_batched(_: Path, outputs: list[str]) -> str:
    """The multi-run trainer's run-steps/s with 4 and 8 runs next to 1 (benchmarks/multi_run.py's table)."""
    ratios = {int(m[1]): float(m[2]) for m in re.finditer(r"^runs(\d+)\s+\d+\s+[\d.]+\s+([\d.]+)", outputs[-1], re.M)}
    said = ", ".join(f"{n} runs {ratios[n]:.2f}x" for n in sorted(ratios) if n > 1)
    assert ratios.get(4, 0) >= 2.5 and ratios.get(8, 0) >= 4, f"run-steps/s vs 1 run: {said} (want 4 >= 2.5x, 8 >= 4x)"
    return f"run-steps/s vs 1 run: {said}"


def teacher_scores(work: Path, _: list[str]) -> str:
    rows = [json.loads(x) for x in (work / "distill" / "metrics" / "orchestrator.jsonl").read_text().splitlines()]
    kl = [r["distill/teacher_kl"] for r in rows if r.get("kind", "train") == "train" and "distill/teacher_kl" in r]
    assert kl, "no step has a distill/teacher_kl (did the teacher score any sample?)"
    assert all(0 <= k < 1e3 for k in kl), f"teacher KL out of range: {kl}"
    early, late = sum(kl[:3]) / len(kl[:3]), sum(kl[-3:]) / len(kl[-3:])
    trained = [json.loads(x) for x in (work / "distill" / "metrics" / "trainer.jsonl").read_text().splitlines()]
    dense = [r["teacher_kl"] for r in trained if "teacher_kl" in r]  # the example's forward KL, on CUDA
    assert dense and all(0 <= k < 1e3 for k in dense), f"trainer's forward KL to the teacher: {dense}"
    return (
        f"{len(kl)} steps scored by the teacher on GPU 0, teacher-student KL {early:.3f} -> {late:.3f}; "
        f"trainer's forward KL {dense[0]:.3f} -> {dense[-1]:.3f}"
    )


IMPORTS = """
import importlib, verifiers as vf
from asyncrl.config.orchestrator import EnvConfig
from asyncrl.orchestrator.envs.loading import load_env
from asyncrl.orchestrator.envs.harness import chat_program
for m in ("rl", "trainer", "inference", "orchestrator", "sft", "eval", "synthesize"):
    importlib.import_module("asyncrl.entrypoints." + m)
for env in ("reverse-text", "echo-twice", "tool-calc"):
    load_env(EnvConfig(id=env))
chat_program()
from renderers import create_renderer  # builds its registry of every model family's renderer (gpt-oss's too)
from renderers.base import load_tokenizer
from asyncrl.utils.tiny_model import build_tiny_model
import tempfile
create_renderer(load_tokenizer(str(build_tiny_model(tempfile.mkdtemp() + "/tiny"))), None)
import torch, transformers, pydantic
print(f"entrypoints and environments import: torch {torch.__version__}, transformers {transformers.__version__}, "
      f"pydantic {pydantic.__version__}, verifiers {vf.__version__}, Python {__import__('platform').python_version()}")
"""

CUDA = """
import torch, torch.distributed as dist
p = torch.cuda.get_device_properties(0)
print(f"{p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, cuDNN {torch.backends.cudnn.version()}")
"""

LOGPROBS = """
import json, sys, httpx, torch
from transformers import AutoModelForCausalLM
from asyncrl.trainer.loss import token_logprobs
url, name = sys.argv[1:3]
out = httpx.post(url + "/v1/chat/completions", timeout=300, json={"model": name, "max_tokens": 48, "n": 16,
    "temperature": 1.0, "logprobs": True, "return_token_ids": True,
    "messages": [{"role": "user", "content": "Reverse the text: the lent GPU"}]}).json()
model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32).cuda().eval()
prompt, diffs, same = out["prompt_token_ids"], [], True
for c in out["choices"]:
    ids = torch.tensor(prompt + c["token_ids"], device="cuda")
    with torch.no_grad():
        lp = token_logprobs(model(input_ids=ids[None]).logits[0], ids, torch.ones(len(ids), device="cuda"))
    served = torch.tensor([t["logprob"] for t in c["logprobs"]["content"]], dtype=torch.float64)
    same &= len(served) == len(c["token_ids"])
    diffs.append((lp[len(prompt):].double().cpu() - served).abs())
d = torch.cat(diffs)
print(json.dumps({"tokens": d.numel(), "max_abs": d.max().item(), "mean_abs": d.mean().item(), "same_tokens": same,
                  "dtype": str(model.dtype)}))
"""


def serve(model: Path, out: Path) -> list[str]:
    # float32 as the trainer's recomputation (dtype auto would serve this float32 checkpoint in float16)
    return ["SERVE", PY, "-m", ENTRY + "inference", "--model.name", str(model), "--server.port", str(PORT),
            "--model.dtype", "float32", "--output-dir", str(out)]  # fmt: skip


# the embedded engine's completion tokens/s under many concurrent clients (one repeat, 64 tokens each)
THROUGHPUT = [PY, "benchmarks/inference.py", "--no-hf-reference", "--repeats", "1", "--max-tokens", "64",
              "--hidden-size", "256"]  # fmt: skip
QWEN3_06B = ("hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128, intermediate_size=3072, "
             "vocab_size=151936, max_position_embeddings=40960")  # fmt: skip

CHECKS = [
    Check("imports", lambda w: [[PY, "-c", IMPORTS]], last_line, 60),
    Check("cuda", lambda w: [[PY, "-c", CUDA]], last_line, 30),
    Check("fsdp2_nccl", lambda w: [trainer_bench(str(w / "tiny"), 2048)], bench_line, 90, ["cuda"]),
    Check(
        "shared_prefix_cuda_attention",
        lambda w: [[PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(SHARED_PREFIX_TEST)]],
        tests_pass,
        90,
        ["cuda"],
    ),  # fmt: skip
    Check(
        "engine_logprobs_vs_trainer",
        lambda w: [serve(w / "tiny", w / "serve"), [PY, "-c", LOGPROBS, f"http://127.0.0.1:{PORT}", str(w / "tiny")]],
        logprobs_match,
        90,
        ["cuda"],
    ),  # fmt: skip
    Check(
        "engine_cuda_throughput",
        lambda w: [
            [*THROUGHPUT, "--concurrency", "64,128,256"],
            [*THROUGHPUT, "--concurrency", "64", "--dtype", "float32"],
        ],
        throughput,
        120,
        ["cuda"],
    ),  # fmt: skip
    Check(
        "bench_qwen3_0.6b_16k",
        lambda w: [qwen3_06b(w), trainer_bench(str(w / "qwen3-0.6b"), 16384, "--model.optimization-dtype", "bfloat16")],
        bench_line,
        150,
        ["fsdp2_nccl"],
    ),  # fmt: skip
    Check(
        "bench_qwen3_0.6b_16k_ac",
        lambda w: [
            qwen3_06b(w),
            trainer_bench(str(w / "qwen3-0.6b"), 16384, "--model.optimization-dtype", "bfloat16", "--model.ac"),
        ],
        bench_line,
        150,
        ["fsdp2_nccl"],
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
        200,
        ["cuda"],
    ),  # fmt: skip
    Check(
        "rl_multi_run_lora",
        lambda w: [
            [
                PY,
                "-m",
                ENTRY + "rl",
                "@",
                "examples/multi_run/rl.toml",
                "--model.name",
                str(w / "tiny"),
                "--output-dir",
                str(w / "multi"),
                "--max-steps",
                "10",
                *ONE_GPU,
            ],
        ],
        runs_train,
        150,
        ["cuda"],
    ),  # fmt: skip
    Check(
        "multi_run_batched_trainer",
        lambda w: [[PY, "benchmarks/multi_run.py", "--runs", "1", "4", "8", "--steps", "11", "--multi-only"]],
        runs_batched,
        150,
        ["cuda"],
    ),  # fmt: skip
    Check(
        "rl_distill_teacher",
        lambda w: [
            [
                PY,
                "-c",
                f"from asyncrl.utils.tiny_model import build_tiny_model; build_tiny_model('{w / 'teacher'}', seed=1)",
            ],
            [
                PY,
                "-m",
                ENTRY + "rl",
                "@",
                "examples/distill/rl.toml",
                "--model.name",
                str(w / "tiny"),
                "--teacher.model.name",
                str(w / "teacher"),
                "--teacher.gpu-memory-utilization",
                "0.2",
                "--output-dir",
                str(w / "distill"),
                "--max-steps",
                "10",
                *ONE_GPU,
            ],
        ],
        teacher_scores,
        150,
        ["cuda"],
    ),  # fmt: skip
    Check(
        "rl_moe_router_replay",
        lambda w: [
            [PY, "-c", f"from asyncrl.utils.tiny_model import build_tiny_model as b; b('{w / 'moe'}', experts=8)"],
            moe_rl(w, "off"),
            moe_rl(w, "on"),
        ],
        moe_replay,
        200,
        ["cuda"],
    ),  # fmt: skip
    Check("vllm_update_weights", lambda w: [], last_line, skip=NO_VLLM),
    Check("rl_multi_run_lora_vllm", lambda w: [], last_line, skip=NO_VLLM),
]


def run(cmd: list[str], log: Path, deadline: float, servers: list) -> str:
    """Run one command until `deadline` (a `SERVE` one in the background, waited for on /health); its output."""
    from asyncrl.utils.process import spawn, stop_group, wait_for_http

    if cmd[0] == "SERVE":
        servers.append(spawn(cmd[1:], log))
        wait_for_http(f"http://127.0.0.1:{PORT}/health", max(1, deadline - time.monotonic()), servers[-1], log)
        return ""
    proc = spawn(cmd, log)  # its own process group, run from the repo root (main)
    try:
        code = proc.wait(timeout=max(1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        stop_group(proc, grace=0)  # the whole group, at once
        raise AssertionError("out of its time limit") from None
    text = log.read_text()
    if code:
        raise AssertionError(f"exit {code}: {text.strip().splitlines()[-1:]}")
    return text


def on_gpu(check: Check, work: Path, seconds: float) -> tuple[str, str]:
    from asyncrl.utils.process import stop_groups

    deadline, servers = time.monotonic() + seconds, []
    try:
        logs = (work / f"{check.name}.{i}.log" for i in range(99))
        outputs = [run(cmd, log, deadline, servers) for cmd, log in zip(check.commands(work), logs)]
        return "pass", check.judge(work, outputs)
    except (AssertionError, OSError, RuntimeError, ValueError, KeyError) as e:
        return "FAIL", (str(e) if isinstance(e, AssertionError) else f"{type(e).__name__}: {e}")[:240]
    finally:
        stop_groups(servers)


def dry(check: Check, work: Path, _: float) -> tuple[str, str]:
    """Print the commands and check each: entrypoints' --dry-run, inline scripts compile, tests collect."""
    for cmd in check.commands(work):
        cmd = cmd[1:] if cmd[0] == "SERVE" else cmd
        print("  $", " ".join(a if "\n" not in a else "<script>" for a in cmd))
        module = next((a for a in cmd if a.startswith(ENTRY)), None)
        if module is not None:
            probe = [PY, "-m", module, *cmd[cmd.index(module) + 1 :], "--dry-run"]
        elif cmd[1:3] == ["-m", "pytest"]:
            probe = [*cmd, "--collect-only"]
        elif cmd[1] == "-c" and check.name != "imports":
            compile(cmd[2], check.name, "exec")
            continue
        else:
            probe = cmd if check.name == "imports" else [*cmd, "--help"]
        done = subprocess.run(probe, cwd=REPO, capture_output=True, text=True)
        if done.returncode:
            return "FAIL", f"{(module or cmd[1])} fails: {(done.stdout + done.stderr).strip().splitlines()[-1]}"
    return "dry", "commands resolve (--dry-run, compile, collect)"


def write(rows: list[tuple[str, str, float, str]], out: Path | None, work: Path, device: str) -> None:
    table = [f"device: {device}", "", "| check | status | seconds | result |", "|---|---|---:|---|"]
    table += [f"| {name} | {status} | {seconds:.0f} | {result} |" for name, status, seconds, result in rows]
    print("\n" + "\n".join(table))
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.md").write_text("\n".join(table) + "\n")
    failed = [name for name, status, _, _ in rows if status == "FAIL"]
    tails = [f"== {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-40:])
             for name in failed for log in sorted(work.glob(f"{name}.*.log"))]  # fmt: skip
    (out / "gpu_check.log").write_text("\n\n".join(tails) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry", action="store_true", help="walk every row without running it (the default without CUDA)")
    ap.add_argument("--only", default="", help="comma-separated rows to run (a rerun of the ones that failed)")
    ap.add_argument("--budget", type=float, default=480, help="seconds for all the rows together")
    ap.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
    args = ap.parse_args()
    out = args.out.resolve() if args.out else None
    os.chdir(REPO)  # every command's paths are relative to the repo root
    import torch

    cuda = torch.cuda.is_available() and not args.dry
    print("GPU acceptance run" if cuda else "no CUDA GPU here: dry check only (the commands each check would run)")
    device = torch.cuda.get_device_name(0) if cuda else "none (dry)"
    end, rows, passed = time.monotonic() + args.budget, [], set()
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        work = Path(tmp)
        if cuda:
            from asyncrl.utils.tiny_model import build_tiny_model

            build_tiny_model(work / "tiny", hidden_size=128, num_layers=4)
        for check in CHECKS:
            if args.only and check.name not in args.only.split(","):
                continue
            start, left = time.monotonic(), end - time.monotonic()
            missing = [n for n in check.needs if n not in passed and (not args.only or n in args.only)]
            if check.skip or (cuda and (missing or left < MIN_SECONDS)):
                why = check.skip or (f"not run: {', '.join(missing)} did not pass" if missing else
                                     f"not run: {left:.0f}s of the budget left")  # fmt: skip
                status, result = "skipped", why
            else:
                print(f"== {check.name}", flush=True)
                status, result = (on_gpu if cuda else dry)(check, work, min(check.seconds, left))
            passed |= {check.name} if status in ("pass", "dry") else set()
            rows.append((check.name, status, time.monotonic() - start, result))
            print(f"  {status}: {result} ({rows[-1][2]:.0f}s)", flush=True)
        write(rows, out, work, device)
    return 1 if any(status == "FAIL" for _, status, _, _ in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
