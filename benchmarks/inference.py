"""Inference throughput: completion tokens/s per backend x concurrency, on one tiny local model.

Each backend runs as its own `inference` server process (the embedded engine in this env, vLLM in
.venv-vllm via asyncrl.inference.vllm.launch). For each concurrency c, c clients each send `--rounds`
chat requests back to back (distinct prompts of one fixed length, or one shared prompt with
`--same-prompt`; `--max-tokens` completion tokens, eos ignored), and the table shows aggregate
completion tokens/s, per-request median latency and the speed-up over the first level.

    python benchmarks/inference.py                                # embedded, c = 1, 16, 64
    python benchmarks/inference.py --backends embedded,vllm --hidden-size 256 --num-layers 4
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from asyncrl.utils.process import free_port, serve, stop_group


class EmbeddedServer:
    """`inference` (embedded engine) in a child process of this env."""

    def __init__(
        self,
        model_dir: Path,
        log_dir: Path,
        max_batch_size: int,
        num_threads: int | None,
        extra_args: tuple[str, ...] = (),
    ):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "asyncrl.entrypoints.inference", "--model.name", str(model_dir),
               "--server.host", "127.0.0.1", "--server.port", str(self.port), "--output-dir", str(log_dir),
               "--no-log.file", "--max-batch-size", str(max_batch_size)]  # fmt: skip
        if num_threads is not None:
            cmd += ["--num-threads", str(num_threads)]
        cmd += list(extra_args)
        self.proc = serve(cmd, self.base_url + "/health", log_dir / "embedded.log", 120)

    def stop(self) -> None:
        stop_group(self.proc, 30)


def start(backend: str, model_dir: Path, log_dir: Path, max_batch_size: int, num_threads: int | None):
    if backend == "embedded":
        return EmbeddedServer(model_dir, log_dir, max_batch_size, num_threads)
    if backend == "vllm":
        from asyncrl.inference.vllm.launch import start_vllm_server

        return start_vllm_server(model_dir, log_dir / "vllm.log", ["--model.dtype", "float32", "--model.enforce-eager"])
    raise SystemExit(f"unknown backend '{backend}' (choose from embedded, vllm)")


async def run_level(
    base_url: str, model: str, concurrency: int, rounds: int, prompt_chars: int, max_tokens: int, same_prompt: bool
):
    """c closed-loop clients x rounds requests; returns (completion tokens, wall seconds, latencies)."""
    filler = "abcdefghij" * (prompt_chars // 10 + 1)
    body = {"model": model, "max_tokens": max_tokens, "min_tokens": max_tokens, "ignore_eos": True,
            "temperature": 1.0}  # fmt: skip
    latencies: list[float] = []
    tokens, sent = 0, 0
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:

        def request() -> dict:
            nonlocal sent
            sent += 1
            text = filler if same_prompt else f"{sent:06d} {filler}"  # distinct prompts: no prefix reuse
            return dict(body, messages=[{"role": "user", "content": text[:prompt_chars]}])

        async def one_client() -> None:
            nonlocal tokens
            for _ in range(rounds):
                t0 = time.perf_counter()
                r = await client.post("/v1/chat/completions", json=request())
                r.raise_for_status()
                latencies.append(time.perf_counter() - t0)
                tokens += r.json()["usage"]["completion_tokens"]

        await client.post("/v1/chat/completions", json=dict(request(), max_tokens=4, min_tokens=4))  # warm-up
        t0 = time.perf_counter()
        await asyncio.gather(*[one_client() for _ in range(concurrency)])
        wall = time.perf_counter() - t0
    return tokens, wall, latencies


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="embedded", help="comma-separated: embedded, vllm")
    ap.add_argument("--concurrency", default="1,16,64", help="comma-separated client counts")
    ap.add_argument("--rounds", type=int, default=2, help="requests per client per level")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-chars", type=int, default=48, help="user message length (1 token per byte)")
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--model-dir", type=Path, default=None, help="serve this model instead of building one")
    ap.add_argument("--num-threads", type=int, default=None, help="embedded engine: torch threads")
    ap.add_argument("--same-prompt", action="store_true", help="one prompt for all requests (prefix reuse)")
    args = ap.parse_args()

    levels = [int(c) for c in args.concurrency.split(",")]
    work = Path(tempfile.mkdtemp(prefix="asyncrl-bench-inference-"))
    model_dir = args.model_dir
    if model_dir is None:
        from asyncrl.utils.tiny_model import build_tiny_model

        model_dir = build_tiny_model(work / "model", hidden_size=args.hidden_size, num_layers=args.num_layers)
    print(f"model {model_dir} (hidden {args.hidden_size}, {args.num_layers} layers), prompt {args.prompt_chars} "
          f"chars ({'one prompt' if args.same_prompt else 'distinct prompts'}), {args.max_tokens} completion tokens, "
          f"{args.rounds} rounds/client, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}")  # fmt: skip

    rows = []
    for backend in args.backends.split(","):
        server = start(backend, model_dir, work, max(levels), args.num_threads)
        try:
            base_tps = None
            for c in levels:
                tokens, wall, lat = asyncio.run(
                    run_level(
                        server.base_url,
                        str(model_dir),
                        c,
                        args.rounds,
                        args.prompt_chars,
                        args.max_tokens,
                        args.same_prompt,
                    )  # fmt: skip
                )
                tps = tokens / wall
                base_tps = base_tps or tps
                rows.append((backend, c, tps, statistics.median(lat), tps / base_tps))
                print(f"  {backend:9s} c={c:<3d} {tps:8.0f} tok/s", flush=True)
        finally:
            server.stop()

    print(f"\n| backend | concurrency | completion tok/s | median latency (s) | vs c={levels[0]} |")
    print("|---|---:|---:|---:|---:|")
    for backend, c, tps, lat, speedup in rows:
        print(f"| {backend} | {c} | {tps:.0f} | {lat:.2f} | {speedup:.1f}x |")


if __name__ == "__main__":
    main()
