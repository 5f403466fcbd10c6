"""Multi-turn chat on the embedded engine with its prefix cache on and off: wall time per workload.

Each of `--conversations` clients holds a conversation with a long shared system prompt (like a
tool schema) for `--turns` turns; every turn resends the whole history plus a new user message,
as verifiers' multi-turn and tool environments do. With the prefix cache, a turn reuses the KV
of the previous turn (and every conversation the system prompt's), so only new tokens are prefilled.

    python benchmarks/multi_turn.py                       # 16 conversations x 3 turns, ~750-token system prompt
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from inference import EmbeddedServer  # noqa: E402  (the sibling benchmark's server wrapper)


async def run_workload(
    base_url: str, model: str, conversations: int, turns: int, system_chars: int, max_tokens: int, run: int
) -> tuple[float, int]:
    """Wall seconds for all conversations (run concurrently) and the prompt tokens they sent."""
    # the run number leads the system prompt, so no run reuses an earlier run's cache
    system = (f"Run {run}. " + "You answer briefly. " * (system_chars // 20 + 1))[:system_chars]
    prompt_tokens = 0
    async with httpx.AsyncClient(
        base_url=base_url, timeout=600, limits=httpx.Limits(max_connections=conversations + 4)
    ) as client:

        async def conversation(i: int) -> None:
            nonlocal prompt_tokens
            messages = [{"role": "system", "content": system}]
            for t in range(turns):
                messages.append({"role": "user", "content": f"conversation {i:03d}, turn {t}: go on"})
                r = await client.post(
                    "/v1/chat/completions",
                    json={
                        "model": model,
                        "messages": messages,
                        "max_tokens": max_tokens,
                        "min_tokens": max_tokens,
                        "ignore_eos": True,
                        "temperature": 1.0,
                    },
                )
                r.raise_for_status()
                body = r.json()
                prompt_tokens += body["usage"]["prompt_tokens"]
                messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})

        t0 = time.perf_counter()
        await asyncio.gather(*[conversation(i) for i in range(conversations)])
        return time.perf_counter() - t0, prompt_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--system-chars", type=int, default=750, help="shared system prompt (1 token per byte)")
    ap.add_argument("--max-tokens", type=int, default=32, help="assistant tokens per turn")
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2, help="runs per mode (alternating); the best is reported")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="asyncrl-bench-multiturn-"))
    from asyncrl.utils.tiny_model import build_tiny_model

    model_dir = build_tiny_model(work / "model", hidden_size=args.hidden_size, num_layers=args.num_layers)
    print(
        f"tiny model hidden {args.hidden_size} x {args.num_layers} layers; {args.conversations} conversations x "
        f"{args.turns} turns, system prompt {args.system_chars} chars, {args.max_tokens} tokens/turn; "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}"
    )
    modes = {"prefix cache on": (), "prefix cache off": ("--prefix-cache-gb", "0")}
    servers = {m: EmbeddedServer(model_dir, work, args.conversations, None, extra) for m, extra in modes.items()}
    best: dict[str, tuple[float, int]] = {}
    try:
        for run in range(args.repeats):
            for mode, server in servers.items():
                result = asyncio.run(
                    run_workload(
                        server.base_url,
                        str(model_dir),
                        args.conversations,
                        args.turns,
                        args.system_chars,
                        args.max_tokens,
                        run,
                    )
                )
                print(f"  {mode}: {result[0]:.2f}s", flush=True)
                if mode not in best or result[0] < best[mode][0]:
                    best[mode] = result
    finally:
        for server in servers.values():
            server.stop()

    off = best["prefix cache off"][0]
    print("\n| mode | wall s | prompt tokens sent | prompt tok/s | time vs off |")
    print("|---|---:|---:|---:|---:|")
    for mode, (wall, prompt_tokens) in best.items():
        print(f"| {mode} | {wall:.2f} | {prompt_tokens} | {prompt_tokens / wall:,.0f} | {wall / off:.2f} |")


if __name__ == "__main__":
    main()
