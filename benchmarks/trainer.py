"""Trainer throughput: runs `trainer --bench` on fake packed batches and prints tokens/s, MFU and peak memory.

    python benchmarks/trainer.py                    # tiny models on CPU, 1 and 2 processes (gloo)
    python benchmarks/trainer.py --qwen3-0.6b       # + Qwen3-0.6B-shaped random weights at seq 16k (GPU)
    python benchmarks/trainer.py --rows-sweep       # only the bench job's shape: data.micro_batch_size x dtype
    python benchmarks/trainer.py --logits           # a 152k vocabulary on CPU: the chunked lm_head vs full logits

Every run is a fresh `python -m asyncrl.entrypoints.trainer --bench` (under torchrun for 2 ranks); the
numbers come from its metrics file, the first (warm-up) step excluded. MFU needs a known GPU peak
(bf16 dense); on CPU it is n/a. Published reference: Qwen3-0.6B RL at 16k on 1xH100, 11.1% MFU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CPU_CASES = [
    # name, hidden, layers, heads, kv heads, ranks, seq_len, samples_per_row, batch_size
    ("tiny-1M", 128, 4, 4, 2, 1, 256, 4, 16),
    ("tiny-1M", 128, 4, 4, 2, 2, 256, 4, 16),
    ("small-10M", 384, 6, 6, 2, 1, 256, 4, 16),
    ("small-10M", 384, 6, 6, 2, 2, 256, 4, 16),
]

# the bench job's trainer step on tiny-1M: 129 samples of 85 tokens, 3 per 255-token row = 43 rows
JOB_SHAPE = {"seq_len": 85, "samples_per_row": 3, "batch_size": 129}
ROWS_PER_FORWARD = (1, 2, 4, 8, 16)
# --logits: Qwen3's vocabulary on a small body (hidden, layers, heads, kv heads), where the logits dominate memory
LOGITS_MODEL = (256, 2, 4, 2)
LOGITS_SETTINGS = {"full logits": ["--model.fused-lm-head-chunk-size", "disabled"], "chunked head (default)": []}
DTYPES = ("float32", "bfloat16")


def build_qwen3_06b_shape(out: Path) -> Path:
    """Random weights in Qwen3-0.6B's shape (no download), with the tiny byte tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from asyncrl.utils.tiny_model import build_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out)
    cfg = Qwen3Config(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
        rope_theta=1_000_000,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(out)
    return out


def time_trainer(
    model_dir: Path, out: Path, ranks: int, seq: int, per_row: int, bs: int, steps: int, extra: list[str], threads: int
) -> dict:
    """`per_row` samples packed per row of fake data; `extra` may set --data.micro-batch-size (rows per forward)."""
    fake = json.dumps({"seq_len": seq, "samples_per_row": per_row, "batch_size": bs})
    args = [
        "-m",
        "asyncrl.entrypoints.trainer",
        "--model.name",
        str(model_dir),
        "--output-dir",
        str(out),
        "--bench",
        "--max-steps",
        str(steps),
        "--data.fake",
        fake,
        "--log.level",
        "warning",
        *extra,
    ]
    if ranks > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), *args]
    else:
        cmd = [sys.executable, *args]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"bench run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    rows = [json.loads(x) for x in (out / "metrics" / "trainer.jsonl").read_text().splitlines()][1:]
    seconds = sum(r["step_time_s"] for r in rows)
    mfus = [r["mfu"] for r in rows if r["mfu"] is not None]
    return {
        "tok_s": sum(r["tokens"] for r in rows) / seconds,
        "mfu": sum(mfus) / len(mfus) if mfus else None,
        "mem": max(r["peak_mem_gib"] for r in rows),
        "step_s": seconds / len(rows),
    }


def params_of(model_dir: Path) -> int:
    from safetensors import safe_open

    total = 0
    for f in model_dir.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            total += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())
    return total


def rows_sweep(root: Path, steps: int, threads: int) -> list[tuple[int, str, dict]]:
    """The bench job's shape for every rows-per-forward and compute dtype, run interleaved in one invocation."""
    from asyncrl.utils.tiny_model import build_tiny_model

    model_dir = build_tiny_model(root / "tiny-1M", hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2)
    shape = (JOB_SHAPE["seq_len"], JOB_SHAPE["samples_per_row"], JOB_SHAPE["batch_size"])
    results = []
    for rows in ROWS_PER_FORWARD:
        for dtype in DTYPES:
            extra = ["--device", "cpu", "--data.micro-batch-size", str(rows), "--model.optimization-dtype", dtype]
            out = root / f"out-rows{rows}-{dtype}"
            results.append((rows, dtype, time_trainer(model_dir, out, 1, *shape, steps, extra, threads)))
    return results


def print_rows_sweep(results: list[tuple[int, str, dict]], threads: int) -> None:
    base = next(r["step_s"] for rows, dtype, r in results if rows == 1 and dtype == "float32")
    print(f"\nRL job shape on tiny-1M: 43 rows of 255 tokens per step, 1 rank, {threads} thread(s)")
    print(f"{'rows/fwd':>8} {'dtype':<9} {'step s':>7} {'tokens/s':>9} {'vs 1 row fp32':>14}")
    for rows, dtype, r in results:
        print(f"{rows:>8} {dtype:<9} {r['step_s']:>7.3f} {r['tok_s']:>9,.0f} {base / r['step_s']:>13.2f}x")
    print(f"(load average {os.getloadavg()[0]:.1f})")


def logits_sweep(root: Path, seq: int, steps: int, threads: int) -> list[tuple[str, dict]]:
    """One `seq`-token sample per step through full logits and through the chunked head, twice each, interleaved."""
    from asyncrl.utils.tiny_model import build_tiny_model

    hidden, layers, heads, kv = LOGITS_MODEL
    model_dir = build_tiny_model(
        root / "vocab-152k", hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv, vocab_size=151936
    )
    results = []
    for i in range(2):
        for name, extra in LOGITS_SETTINGS.items():
            out = root / f"out-logits-{i}-{len(extra)}"
            results.append(
                (name, time_trainer(model_dir, out, 1, seq, 1, 1, steps, ["--device", "cpu", *extra], threads))
            )
    return results


def print_logits_sweep(results: list[tuple[str, dict]], seq: int, threads: int) -> None:
    hidden, layers, *_ = LOGITS_MODEL
    print(
        f"\nvocab 151,936, hidden {hidden}, {layers} layers: one {seq}-token row per step, 1 rank, {threads} thread(s)"
    )
    print(f"{'loss reads':<24} {'step s':>7} {'tokens/s':>9} {'peak RSS':>9}")
    for name, r in results:
        print(f"{name:<24} {r['step_s']:>7.2f} {r['tok_s']:>9,.0f} {r['mem']:>7.2f}Gi")
    print(f"(logits of one row: {seq * 151936 * 4 / 2**30:.2f} GiB in float32; load average {os.getloadavg()[0]:.1f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="steps per run (the first is warm-up)")
    parser.add_argument("--skip-cpu", action="store_true", help="skip the tiny CPU cases")
    parser.add_argument("--qwen3-0.6b", dest="qwen", action="store_true", help="Qwen3-0.6B shape, seq 16k, GPU")
    parser.add_argument("--seq-len", type=int, default=16384, help="sequence length of the Qwen3-0.6B case")
    parser.add_argument("--ac", action="store_true", help="activation checkpointing in the Qwen3-0.6B case")
    parser.add_argument(
        "--rows-sweep", action="store_true", help="only the bench job's shape, data.micro_batch_size x dtype"
    )
    parser.add_argument(
        "--logits", action="store_true", help="only the large-vocabulary case: chunked head vs full logits"
    )
    parser.add_argument("--logits-seq-len", type=int, default=4096, help="tokens per step of the --logits case")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads per process (default: CPU cores / ranks; use 1 on a busy machine)",
    )
    args = parser.parse_args()
    from asyncrl.utils.tiny_model import build_tiny_model

    cores = os.cpu_count() or 1
    if args.logits:
        with tempfile.TemporaryDirectory() as tmp:
            threads = args.threads or cores
            print_logits_sweep(
                logits_sweep(Path(tmp), args.logits_seq_len, args.steps, threads), args.logits_seq_len, threads
            )
        return
    if args.rows_sweep:
        with tempfile.TemporaryDirectory() as tmp:
            threads = args.threads or cores
            print_rows_sweep(rows_sweep(Path(tmp), args.steps, threads), threads)
        return
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if not args.skip_cpu:
            for name, hidden, layers, heads, kv, ranks, seq, per_row, bs in CPU_CASES:
                model_dir = root / name
                if not model_dir.exists():
                    build_tiny_model(model_dir, hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv)
                out = root / f"out-{name}-{ranks}"
                r = time_trainer(
                    model_dir,
                    out,
                    ranks,
                    seq,
                    per_row,
                    bs,
                    args.steps,
                    ["--device", "cpu"],
                    threads=args.threads or max(1, cores // ranks),
                )
                results.append((name, params_of(model_dir), "cpu fp32", ranks, f"{seq}x{per_row}x{bs}", r))
        if args.qwen:
            model_dir = build_qwen3_06b_shape(root / "qwen3-0.6b")
            extra = ["--device", "cuda", "--model.optimization-dtype", "bfloat16", "--model.reduce-dtype", "float32"]
            if args.ac:
                extra += ["--model.ac.freq", "1"]
            r = time_trainer(model_dir, root / "out-qwen", 1, args.seq_len, 1, 1, args.steps, extra, threads=8)
            results.append(
                (
                    "qwen3-0.6b-shape",
                    params_of(model_dir),
                    "cuda bf16" + (" ac" if args.ac else ""),
                    1,
                    f"{args.seq_len}x1x1",
                    r,
                )
            )

    print(
        f"\n{'model':<18} {'params':>8} {'device':<13} {'ranks':>5} {'seq x per_row x bs':>18} "
        f"{'tokens/s':>10} {'step s':>8} {'MFU':>7} {'peak mem':>9}"
    )
    for name, n, dev, ranks, shape, r in results:
        mfu = f"{r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        print(
            f"{name:<18} {n / 1e6:>7.1f}M {dev:<13} {ranks:>5} {shape:>18} {r['tok_s']:>10,.0f} "
            f"{r['step_s']:>8.2f} {mfu:>7} {r['mem']:>7.2f}Gi"
        )
    print(
        f"({cores} CPU cores, load average {os.getloadavg()[0]:.1f}; "
        "CPU peak memory is process RSS, GPU peak is allocated memory; "
        "MFU vs dense bf16 peak, published Qwen3-0.6B 16k 1xH100: 11.1%)"
    )


if __name__ == "__main__":
    main()
