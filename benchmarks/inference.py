"""Inference throughput: completion tokens/s per backend x concurrency, on one tiny local model,
with batched HF `generate` on the same prompts as the reference, measured in the same run.

Each backend runs as its own `inference` server process (the embedded engine in this env, vLLM in
.venv-vllm via asyncrl.inference.vllm.launch). For each concurrency c, c clients each send `--rounds`
chat requests back to back, and the table shows aggregate completion tokens/s (median of
`--repeats`), per-request median latency and the speed-up over the first level. Two request shapes:

- `--shape rl` (default): what `rl --bench` sends. A system prompt plus a short word, each prompt
  sent by a group of `--group-size` requests at once (the rollouts of one example), non-streaming,
  with `logprobs` and `return_token_ids` as verifiers asks for them.
- `--shape distinct`: one user message of `--prompt-chars` per request, every prompt different.

Every completion runs the full `--max-tokens` (eos ignored), so tok/s compare across backends.
`hf-generate` rows are one `model.generate` call over the same c prompts (left padding, do_sample,
T=1, the same max/min new tokens), in this process with the engine's torch thread count, run
interleaved with the server levels. The clients are aiohttp (a third of httpx's CPU per request:
on a small machine the client shares the cores with the server it measures), each with its own
keep-alive connection, opened by one tiny request per client before the timed window: a serving
benchmark measures a server's steady state, not TCP set-up.

    python benchmarks/inference.py                                   # embedded, c = 64, 128, 256
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
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from asyncrl.utils.process import free_port, serve, stop_group

SYSTEM_PROMPT = "Reverse the text character by character."  # the rl --bench job's


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


def start(backend: str, model_dir: Path, log_dir: Path, max_batch_size: int, num_threads: int | None, dtype: str):
    if backend == "embedded":
        return EmbeddedServer(model_dir, log_dir, max_batch_size, num_threads, ("--model.dtype", dtype))
    if backend == "vllm":
        from asyncrl.inference.vllm.launch import start_vllm_server

        return start_vllm_server(model_dir, log_dir / "vllm.log", ["--model.dtype", "float32", "--model.enforce-eager"])
    raise SystemExit(f"unknown backend '{backend}' (choose from embedded, vllm)")


@dataclass
class Workload:
    """What each request of a level asks for."""

    shape: str  # "rl" | "distinct"
    max_tokens: int
    prompt_chars: int
    group_size: int

    def messages(self, k: int, salt: int) -> list[dict]:
        """Messages of the k-th request of a level (`salt` keeps levels and repeats apart)."""
        if self.shape == "rl":
            word = _word(salt * 100_000 + k // self.group_size)
            return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": word}]
        filler = "abcdefghij" * (self.prompt_chars // 10 + 1)
        return [{"role": "user", "content": f"{salt:04d}{k:06d} {filler}"[: self.prompt_chars]}]

    def body(self, model: str, k: int, salt: int) -> dict:
        body = {"model": model, "messages": self.messages(k, salt), "max_tokens": self.max_tokens,
                "min_tokens": self.max_tokens, "ignore_eos": True, "temperature": 1.0}  # fmt: skip
        if self.shape == "rl":
            body.update(logprobs=True, return_token_ids=True)
        return body


def _word(i: int) -> str:
    """A distinct 5-8 letter word per index (the reverse-text env's prompts are such words)."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    out = ""
    for _ in range(5 + i % 4):
        i, r = divmod(i * 7 + 3, 26)
        out += letters[r]
    return out


async def run_level(base_url: str, model: str, concurrency: int, rounds: int, work: Workload, salt: int):
    """c closed-loop clients x rounds requests; returns (completion tokens, wall seconds, latencies)."""
    latencies: list[float] = []
    tokens = 0
    url = base_url + "/v1/chat/completions"
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(600)
    ) as http:

        async def post(body: dict) -> dict:
            async with http.post(url, json=body) as resp:
                resp.raise_for_status()
                return await resp.json()

        async def one_client(i: int) -> None:
            nonlocal tokens
            for r in range(rounds):
                t0 = time.perf_counter()
                out = await post(work.body(model, r * concurrency + i, salt))
                latencies.append(time.perf_counter() - t0)
                tokens += out["usage"]["completion_tokens"]

        warm = dict(work.body(model, 0, -1), max_tokens=1, min_tokens=1)
        await asyncio.gather(*[post(warm) for _ in range(concurrency)])  # every client's connection open
        t0 = time.perf_counter()
        await asyncio.gather(*[one_client(i) for i in range(concurrency)])
        wall = time.perf_counter() - t0
    return tokens, wall, latencies


class HFReference:
    """Batched HF `generate` over the same chat prompts (left padding, sampling at T=1)."""

    def __init__(self, model_dir: Path, num_threads: int):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(num_threads)
        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def run(self, work: Workload, concurrency: int, salt: int) -> tuple[int, float]:
        """(completion tokens, seconds) of one generate call over `concurrency` prompts."""
        torch = self.torch
        prompts = [self.prompt_ids(work.messages(k, salt)) for k in range(concurrency)]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0,
                                      top_k=0, top_p=1.0, max_new_tokens=work.max_tokens,
                                      min_new_tokens=work.max_tokens, pad_token_id=0)  # fmt: skip
        return (out.shape[1] - width) * concurrency, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="embedded", help="comma-separated: embedded, vllm")
    ap.add_argument("--concurrency", default="64,128,256", help="comma-separated client counts")
    ap.add_argument("--rounds", type=int, default=1, help="requests per client per level")
    ap.add_argument("--repeats", type=int, default=3, help="measure each level this many times (median)")
    ap.add_argument("--shape", choices=["rl", "distinct"], default="rl", help="request shape (see above)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=8, help="rl shape: requests sharing one prompt")
    ap.add_argument("--prompt-chars", type=int, default=48, help="distinct shape: user message length")
    ap.add_argument("--hidden-size", type=int, default=128)
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--model-dir", type=Path, default=None, help="serve this model instead of building one")
    ap.add_argument("--num-threads", type=int, default=None, help="embedded engine (and HF reference): torch threads")
    ap.add_argument(
        "--dtype", default="auto", help="embedded engine's --model.dtype (auto: float16 on CUDA, float32 on CPU)"
    )
    ap.add_argument("--no-hf-reference", action="store_true", help="skip the HF generate rows")
    args = ap.parse_args()

    levels = [int(c) for c in args.concurrency.split(",")]
    work = Workload(args.shape, args.max_tokens, args.prompt_chars, args.group_size)
    tmp = Path(tempfile.mkdtemp(prefix="asyncrl-bench-inference-"))
    model_dir = args.model_dir
    if model_dir is None:
        from asyncrl.utils.tiny_model import build_tiny_model

        model_dir = build_tiny_model(tmp / "model", hidden_size=args.hidden_size, num_layers=args.num_layers,
                                     num_heads=4, num_kv_heads=2, intermediate_size=4 * args.hidden_size)  # fmt: skip
    threads = args.num_threads or max(1, (os.cpu_count() or 2) - 1)  # the engine's default on CPU
    hf = None if args.no_hf_reference else HFReference(model_dir, threads)
    print(f"model {model_dir}, shape {args.shape}, {args.max_tokens} completion tokens, {args.rounds} round(s)/client, "
          f"{args.repeats} repeats, {os.cpu_count()} CPUs, {threads} torch thread(s), "
          f"load average {os.getloadavg()[0]:.1f}")  # fmt: skip

    samples: dict[tuple[str, int], list[tuple[float, float]]] = {}  # (backend, c) -> [(tok/s, median latency)]
    for backend in args.backends.split(","):
        server = start(backend, model_dir, tmp, max(levels), args.num_threads, args.dtype)
        try:
            for rep in range(args.repeats):
                for c in levels:
                    salt = rep * 1000 + c
                    if hf is not None and backend == args.backends.split(",")[0]:
                        tokens, wall = hf.run(work, c * args.rounds, salt)
                        samples.setdefault(("hf-generate", c), []).append((tokens / wall, wall))
                        print(f"  hf-generate c={c:<3d} {tokens / wall:8.0f} tok/s", flush=True)
                    tokens, wall, lat = asyncio.run(run_level(server.base_url, str(model_dir), c, args.rounds, work,
                                                              salt))  # fmt: skip
                    samples.setdefault((backend, c), []).append((tokens / wall, statistics.median(lat)))
                    print(f"  {backend:11s} c={c:<3d} {tokens / wall:8.0f} tok/s", flush=True)
        finally:
            server.stop()
    print_table(samples, levels)
    print(f"load average after: {os.getloadavg()[0]:.1f}")


def print_table(samples: dict[tuple[str, int], list[tuple[float, float]]], levels: list[int]) -> None:
    print(f"\n| backend | concurrency | completion tok/s (median) | runs | median latency (s) | vs c={levels[0]} |")
    print("|---|---:|---:|---|---:|---:|")
    for backend in dict.fromkeys(b for b, _ in samples):
        base = None
        for c in levels:
            runs = samples.get((backend, c))
            if not runs:
                continue
            tps = statistics.median(r[0] for r in runs)
            base = base or tps
            lat = statistics.median(r[1] for r in runs)
            spread = ", ".join(f"{r[0]:.0f}" for r in runs)
            print(f"| {backend} | {c} | {tps:.0f} | {spread} | {lat:.2f} | {tps / base:.2f}x |")


if __name__ == "__main__":
    main()
