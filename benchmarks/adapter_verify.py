"""What verifying an adapter load costs on vLLM: the workers' read-back against the whole `/load_lora_adapter`.

Builds a random Qwen3 of `--hidden`/`--layers` locally and two random PEFT adapters of rank `--rank` on all
seven projections, starts an `inference --backend vllm` server with LoRA on, loads the two adapters in turn
under one name `--loads` times (each load replaces the last in place, as an RL step does), and prints the
median wall time of a load and of its read-back (the server's own log line `the workers' copies read back in
N ms`), with each load's answer checked against the adapter's files.

    .venv/bin/python benchmarks/adapter_verify.py [--hidden 1024] [--layers 8] [--rank 32] [--loads 7]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from safetensors.torch import save_file
from transformers import AutoConfig

from asyncrl.transport import fingerprint
from asyncrl.utils.process import free_port, serve, stop_group
from asyncrl.utils.tiny_model import build_tiny_model

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")  # fmt: skip


def write_adapter(model_dir: Path, out: Path, rank: int, seed: int) -> None:
    """A random PEFT adapter (bfloat16, as the trainer publishes) with its fingerprint.json."""
    cfg, g = AutoConfig.from_pretrained(model_dir), torch.Generator().manual_seed(seed)
    heads, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    hid, mid = cfg.hidden_size, cfg.intermediate_size
    shapes = {"q_proj": (heads, hid), "k_proj": (kv, hid), "v_proj": (kv, hid), "o_proj": (hid, heads),
              "gate_proj": (mid, hid), "up_proj": (mid, hid), "down_proj": (hid, mid)}  # fmt: skip
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for proj in PROJECTIONS:
            n_out, n_in = shapes[proj.split(".")[1]]
            key = f"base_model.model.model.layers.{layer}.{proj}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, n_in, generator=g) * 0.02).to(torch.bfloat16)
            tensors[f"{key}.lora_B.weight"] = (torch.randn(n_out, rank, generator=g) * 0.02).to(torch.bfloat16)
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": [p.split(".")[1] for p in PROJECTIONS], "bias": "none"}))  # fmt: skip
    fingerprint.write(out, fingerprint.of_tensors(tensors))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--loads", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "model", hidden_size=args.hidden, num_layers=args.layers, num_heads=8)
        adapters = [Path(tmp) / f"adapter{i}" for i in range(2)]
        for i, d in enumerate(adapters):
            write_adapter(model, d, args.rank, seed=i)
        mib = (adapters[0] / "adapter_model.safetensors").stat().st_size / 2**20
        port, log = free_port(), Path(tmp) / "server.log"
        cmd = [sys.executable, "-m", "asyncrl.entrypoints.inference", "--model.name", str(model), "--backend", "vllm",
               "--server.port", str(port), "--model.max-model-len", "512", "--enable-lora", "--max-lora-rank",
               str(args.rank), "--output-dir", tmp]  # fmt: skip
        proc = serve(cmd, f"http://127.0.0.1:{port}/health", log, timeout=600)
        walls = []
        try:
            for i in range(args.loads):
                body = {"lora_name": "run", "lora_path": str(adapters[i % 2])}
                start = time.perf_counter()
                r = httpx.post(f"http://127.0.0.1:{port}/load_lora_adapter", json=body, timeout=600)
                walls.append(time.perf_counter() - start)
                assert r.status_code == 200, r.text
                assert fingerprint.mismatch(adapters[i % 2], r.json()["fingerprint"]) is None, r.text[:300]
        finally:
            stop_group(proc)
        said = log.read_text(errors="replace") + "".join(
            p.read_text(errors="replace") for p in Path(tmp).rglob("*.log")
        )
        reads = [float(m) for m in re.findall(r"the workers' copies read back in (\d+) ms", said)][: args.loads]
    load_ms, read_ms = statistics.median(walls) * 1e3, statistics.median(reads)
    print(f"\nvLLM, hidden {args.hidden}, {args.layers} layers, rank {args.rank} on 7 projections, {args.loads} loads")
    print("| adapter (bf16) | /load_lora_adapter | of it: read-back | % of the load |")
    print("|---|---|---|---|")
    print(f"| {mib:.1f} MiB | {load_ms:.0f} ms | {read_ms:.0f} ms | {100 * read_ms / load_ms:.0f}% |")


if __name__ == "__main__":
    main()
