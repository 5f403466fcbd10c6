"""What a weight update costs a streaming client: the gaps between the tokens it receives while updates land.

Starts an `inference` server (`--backend`, default the embedded engine) on a random Qwen3 of
`--hidden`/`--layers` built locally, streams `--tokens` completion tokens from it (`ignore_eos`), once
undisturbed and once while another thread posts `/update_weights` every `--every` seconds (two weight dirs
in turn, each a complete model), and prints, per phase, the gaps between successive streamed chunks: p50,
p99 and the largest, in ms, with the updates' own time (tokens that arrive in one chunk: a gap of 0).

    .venv/bin/python benchmarks/update_gap.py [--backend embedded|vllm] [--tokens 600] [--every 1.0]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from asyncrl.utils.process import free_port, serve, stop_group
from asyncrl.utils.tiny_model import build_tiny_model


def stream_gaps(url: str, model: str, tokens: int) -> list[float]:
    """The gaps (s) between the tokens of one streamed completion of `tokens` tokens, as they arrive (a chunk per
    token, its text complete or not: `return_token_ids`)."""
    body = {"model": model, "prompt": "The", "max_tokens": tokens, "ignore_eos": True, "stream": True}
    body["return_token_ids"] = True
    arrivals = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        for line in sse_lines(r.iter_bytes()):
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                ids = json.loads(line[6:])["choices"][0].get("token_ids") or []
                arrivals += [time.perf_counter()] * len(ids)
    return [b - a for a, b in zip(arrivals, arrivals[1:])]


def sse_lines(chunks):
    """The lines of an event stream, split at b"\\n" only (text may hold U+2028, which str.splitlines splits at)."""
    pending = b""
    for chunk in chunks:
        *lines, pending = (pending + chunk).split(b"\n")
        yield from lines


def updating(url: str, dirs: list[Path], every: float, stop: threading.Event, took: list[float]) -> None:
    i = 0
    while not stop.wait(every):
        start = time.perf_counter()
        r = httpx.post(f"{url}/update_weights", json={"weight_dir": str(dirs[i % 2])}, timeout=600)
        r.raise_for_status()
        took.append(time.perf_counter() - start)
        i += 1


def row(name: str, gaps: list[float], updates: list[float]) -> str:
    q = statistics.quantiles(gaps, n=100)
    update = f"{len(updates)} x {statistics.median(updates) * 1e3:.0f} ms" if updates else "-"
    return f"| {name} | {len(gaps) + 1} | {q[49] * 1e3:.1f} | {q[98] * 1e3:.1f} | {max(gaps) * 1e3:.1f} | {update} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="embedded", choices=["embedded", "vllm"])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=600)
    parser.add_argument("--every", type=float, default=1.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        dirs = [
            build_tiny_model(Path(tmp) / f"m{i}", hidden_size=args.hidden, num_layers=args.layers, num_heads=8, seed=i)
            for i in range(2)
        ]
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "asyncrl.entrypoints.inference", "--model.name", str(dirs[0])]
        cmd += ["--server.port", str(port), "--backend", args.backend, "--model.max-model-len", str(args.tokens + 64)]
        proc = serve(cmd, f"{url}/health", Path(tmp) / "server.log", timeout=600)
        try:
            stream_gaps(url, str(dirs[0]), 32)  # warm up
            quiet = stream_gaps(url, str(dirs[0]), args.tokens)
            stop, took = threading.Event(), []
            thread = threading.Thread(target=updating, args=(url, dirs, args.every, stop, took))
            thread.start()
            busy = stream_gaps(url, str(dirs[0]), args.tokens)
            stop.set()
            thread.join()
        finally:
            stop_group(proc)
    print(f"\n{args.backend} engine, hidden {args.hidden}, {args.layers} layers, an update every {args.every:g} s")
    print("| phase | tokens | p50 gap (ms) | p99 gap (ms) | largest (ms) | updates |")
    print("|---|---|---|---|---|---|")
    print(row("no updates", quiet, []))
    print(row("updates landing", busy, took))


if __name__ == "__main__":
    main()
