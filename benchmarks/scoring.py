"""Scoring throughput: prompt tokens/s a server scores with `prompt_logprobs` (a distillation teacher's load),
per backend x concurrency, on one tiny local model, with a plain HF forward over the same prompts as reference.

For each concurrency c, c clients each send one /v1/completions request at once: a token-id prompt of
`--prompt-len` distinct random ids, `max_tokens` 1, `prompt_logprobs` `--top-k` (the orchestrator's teacher
request). The table shows prompt tokens scored per second (all c requests' prompt tokens over the wall time of
the level, median of `--repeats`) and the median request latency. `hf-forward` rows are one batched fp32
forward + log_softmax over the same c prompts in this process, with the engine's torch thread count.

    python benchmarks/scoring.py                                    # embedded, c = 1, 16, 64, 200-token prompts
    python benchmarks/scoring.py --backends embedded,vllm --concurrency 64
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from inference import start  # noqa: E402  (benchmarks/inference.py: one server process per backend)


def prompts(c: int, length: int, vocab: int, salt: int) -> list[list[int]]:
    rng = random.Random(salt)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(c)]


async def run_level(base_url: str, model: str, batch: list[list[int]], top_k: int) -> tuple[float, list[float]]:
    """(wall seconds for all requests, per-request latencies); every answer is checked for its length."""
    latencies: list[float] = []

    async def one(client: httpx.AsyncClient, prompt: list[int]) -> None:
        t0 = time.perf_counter()
        body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": top_k}
        r = await client.post("/v1/completions", json=body)
        r.raise_for_status()
        assert len(r.json()["choices"][0]["prompt_logprobs"]) == len(prompt)
        latencies.append(time.perf_counter() - t0)

    limits = httpx.Limits(max_connections=len(batch))
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*[one(client, p) for p in batch])
        return time.perf_counter() - t0, latencies


def hf_forward(model, batch: list[list[int]]) -> float:
    """Wall seconds of one batched fp32 forward + log_softmax gather over `batch` (same length prompts)."""
    import torch

    t0 = time.perf_counter()
    with torch.no_grad():
        ids = torch.tensor(batch)
        lp = model(ids).logits[:, :-1].float().log_softmax(-1)
        lp.gather(-1, ids[:, 1:, None])
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="embedded", help="comma-separated: embedded, vllm")
    ap.add_argument("--concurrency", default="1,16,64", help="comma-separated request counts sent at once")
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--top-k", type=int, default=0, help="prompt_logprobs value (0: the prompt's own tokens)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hidden-size", type=int, default=128)
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--model-dir", type=Path, default=None, help="serve this model instead of building one")
    ap.add_argument("--num-threads", type=int, default=None, help="embedded engine (and HF reference): torch threads")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    levels = [int(c) for c in args.concurrency.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="asyncrl-bench-scoring-"))
    model_dir = args.model_dir
    if model_dir is None:
        from asyncrl.utils.tiny_model import build_tiny_model

        model_dir = build_tiny_model(tmp / "model", hidden_size=args.hidden_size, num_layers=args.num_layers,
                                     num_heads=4, num_kv_heads=2, intermediate_size=4 * args.hidden_size)  # fmt: skip
    threads = args.num_threads or max(1, (os.cpu_count() or 2) - 1)
    torch.set_num_threads(threads)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    vocab = hf.get_input_embeddings().weight.shape[0]
    print(f"model {model_dir}, {args.prompt_len}-token prompts, prompt_logprobs={args.top_k}, {args.repeats} repeats, "
          f"{os.cpu_count()} CPUs, {threads} torch thread(s), load average {os.getloadavg()[0]:.1f}")  # fmt: skip

    samples: dict[tuple[str, int], list[tuple[float, float]]] = {}  # (backend, c) -> [(tok/s, median latency)]
    for i, backend in enumerate(args.backends.split(",")):
        server = start(backend, model_dir, tmp, max(levels), args.num_threads)
        try:
            for rep in range(args.repeats):
                for c in levels:
                    batch = prompts(c, args.prompt_len, vocab, rep * 1000 + c)
                    tokens = c * args.prompt_len
                    if i == 0:
                        wall = hf_forward(hf, batch)
                        samples.setdefault(("hf-forward", c), []).append((tokens / wall, wall))
                    wall, lat = asyncio.run(run_level(server.base_url, str(model_dir), batch, args.top_k))
                    samples.setdefault((backend, c), []).append((tokens / wall, statistics.median(lat)))
                    print(f"  {backend:11s} c={c:<3d} {tokens / wall:8.0f} prompt tok/s", flush=True)
        finally:
            server.stop()
    print("\n| backend | concurrency | prompt tokens scored/s (median) | runs | median latency (s) |")
    print("|---|---:|---:|---|---:|")
    for (backend, c), runs in sorted(samples.items(), key=lambda kv: (kv[0][0] != "hf-forward", kv[0])):
        tps = statistics.median(r[0] for r in runs)
        spread = ", ".join(f"{r[0]:.0f}" for r in runs)
        print(f"| {backend} | {c} | {tps:.0f} | {spread} | {statistics.median(r[1] for r in runs):.3f} |")
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
