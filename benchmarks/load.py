"""Sustained load on the embedded inference server: N concurrent streaming chats for D seconds.

Builds a tiny model here, starts `inference` on it, warms it up, then keeps `--streams` clients each sending
one streaming chat after another (varied prompts, `--max-tokens` each) for `--seconds`. Prints one table:
requests, errors (non-200, broken streams), time to first token and to the last one (p50 / p99), generated
tokens/s, and the server's RSS after warm-up, at the end and at its peak (sampled every second), beside the
prefix-cache budget it may grow into. Not a test: numbers depend on the machine.

    .venv/bin/python benchmarks/load.py [--streams 256] [--seconds 180] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from asyncrl.utils.process import free_port, spawn, stop_groups, wait_for_http
from asyncrl.utils.tiny_model import build_tiny_model


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def one_chat(http: httpx.AsyncClient, model: str, i: int, max_tokens: int) -> tuple[float, float, int]:
    """(time to first token, time to the end, tokens) of one streaming chat; raises on any error."""
    body = {
        "model": model,
        "stream": True,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": f"Reverse the text: load test number {i} " + "ab" * (i % 17)}],
    }
    start, first, tokens = time.perf_counter(), None, 0
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"].get("content")
            if delta:
                first = first or time.perf_counter()
                tokens += 1
    end = time.perf_counter()
    return (first or end) - start, end - start, tokens


async def load(url: str, model: str, streams: int, seconds: float, max_tokens: int, pid: int) -> dict:
    limits = httpx.Limits(max_connections=streams + 8, max_keepalive_connections=streams + 8)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as http:
        await asyncio.gather(*(one_chat(http, model, i, max_tokens) for i in range(16)))  # warm-up
        rss = [rss_mib(pid)]
        done: list[tuple[float, float, int]] = []
        errors: list[str] = []
        deadline = time.perf_counter() + seconds

        async def client(k: int) -> None:
            i = k
            while time.perf_counter() < deadline:
                try:
                    done.append(await one_chat(http, model, i, max_tokens))
                except Exception as e:  # counted, and the client goes on
                    errors.append(f"{type(e).__name__}: {e}")
                i += streams

        async def sample() -> None:
            while time.perf_counter() < deadline:
                await asyncio.sleep(1)
                rss.append(rss_mib(pid))

        start = time.perf_counter()
        await asyncio.gather(sample(), *(client(k) for k in range(streams)))
        wall = time.perf_counter() - start
    return {"done": done, "errors": errors, "rss": rss, "wall": wall}


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else (values or [float("nan")])[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--seconds", type=float, default=180)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prefix-cache-gb", type=float, default=1.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = str(build_tiny_model(Path(tmp) / "model", hidden_size=128, num_layers=4))
        port = free_port()
        cmd = [sys.executable, "-m", "asyncrl.entrypoints.inference", "--model.name", model, "--server.host"]
        cmd += ["127.0.0.1", "--server.port", str(port), "--prefix-cache-gb", str(args.prefix_cache_gb)]
        log = Path(tmp) / "server.log"
        server = spawn(cmd + ["--output-dir", tmp], log)
        try:
            wait_for_http(f"http://127.0.0.1:{port}/health", 300, server, log)
            r = asyncio.run(
                load(f"http://127.0.0.1:{port}", model, args.streams, args.seconds, args.max_tokens, server.pid)
            )
        finally:
            stop_groups([server])
    ttft, total = [d[0] for d in r["done"]], [d[1] for d in r["done"]]
    tokens = sum(d[2] for d in r["done"])
    print(f"\n{args.streams} concurrent streams for {r['wall']:.0f}s, max_tokens {args.max_tokens}, embedded engine")
    print(
        "| requests | errors | first token p50 / p99 (s) | whole reply p50 / p99 (s) | tokens/s "
        "| RSS MiB after warm-up / end / peak | prefix cache budget |"
    )
    print("|---|---|---|---|---|---|---|")
    print(
        f"| {len(r['done'])} | {len(r['errors'])} | {pct(ttft, 50):.2f} / {pct(ttft, 99):.2f} | "
        f"{pct(total, 50):.2f} / {pct(total, 99):.2f} | {tokens / r['wall']:,.0f} | "
        f"{r['rss'][0]:,.0f} / {r['rss'][-1]:,.0f} / {max(r['rss']):,.0f} | {args.prefix_cache_gb:g} GB |"
    )
    if r["errors"]:
        print("first errors:", r["errors"][:3])


if __name__ == "__main__":
    main()
