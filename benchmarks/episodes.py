"""Orchestrator CPU per rollout and per model turn: direct v1 episodes, verifiers' own v1 machinery, classic.

Starts an embedded-engine server on a tiny model, then runs `--groups` groups of 8 rollouts (16 tokens per
turn) through the orchestrator's own runners, twice (the first round warms up), and prints the second
round's wall time and this process's CPU time per rollout and per model turn, for each path:

- `v1 direct`: a v1 taskset's episodes run direct (`orchestrator.episodes = "direct"`, the default);
- `v1 verifiers`: the same episodes through verifiers' own machinery (`episodes = "verifiers"`);
- `classic` (reverse-text only): `tests/integration/classic_envs/reverse_classic` with verifiers 0.3's token
  client in `.venv-classic` when it exists (`bash scripts/setup.sh --classic`).

`--env` picks the environment: reverse-text (single turn), echo-twice (two turns), tool-calc (tool calls;
its tool servers keep it on verifiers' path, so both v1 rows take that path).

    .venv/bin/python benchmarks/episodes.py [--groups 16] [--env reverse-text|echo-twice|tool-calc]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLASSIC_PY = ROOT / ".venv-classic" / "bin" / "python"

ROUND = """
import asyncio, json, os, sys, time
from asyncrl.config.orchestrator import ClientConfig, EnvConfig, SamplingConfig
from asyncrl.orchestrator.envs.mixture import EnvMixture, group_inputs
from asyncrl.orchestrator.envs.runners import runners_for, sampling_args

env_id, url, model, groups = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
direct, renderer = sys.argv[5] == "direct", json.loads(sys.argv[6])
os.environ.setdefault("BENCH_KEY", "unused")
mixture = EnvMixture.load([EnvConfig(id=env_id)], seq_len=None)
slot = mixture.slots[0]
client = ClientConfig(base_url=url, api_key_var="BENCH_KEY")
kwargs = {"direct": direct, "renderer": renderer} if renderer is not None or not direct else {}
runners = runners_for(mixture.slots, client, model, model, **kwargs)
args = sampling_args(SamplingConfig(max_tokens=16))

async def main():
    rounds = []
    for _ in range(2):
        wall, cpu = time.time(), time.process_time()
        runs = (runners.run_group(slot, group_inputs(slot.rows[i], 8), args) for i in range(groups))
        outs = await asyncio.gather(*runs)
        errors = sum(1 for g in outs for o in g if o.get("error"))
        turns = sum(len(o.get("trajectory") or []) for g in outs for o in g)
        rounds.append((time.time() - wall, time.process_time() - cpu, errors, turns))
    await runners.close()
    return rounds[-1]

wall, cpu, errors, turns = asyncio.run(main())
print(json.dumps({"wall": wall, "cpu": cpu, "errors": errors, "turns": turns}))
"""


def measure(
    python: str, env_id: str, url: str, model: Path, groups: int, path: str, renderer=None, pythonpath: str = ""
) -> dict:
    env = {**os.environ, "PYTHONPATH": pythonpath} if pythonpath else dict(os.environ)
    cmd = [python, "-c", ROUND, env_id, url, str(model), str(groups), path, json.dumps(renderer)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"{env_id}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=16, help="groups of 8 rollouts per round")
    ap.add_argument("--env", default="reverse-text", choices=["reverse-text", "echo-twice", "tool-calc"])
    args = ap.parse_args()
    from inference import EmbeddedServer  # benchmarks/inference.py: `inference` on the embedded engine

    from asyncrl.utils.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "model")
        (Path(tmp) / "server").mkdir()
        tools = ("--log.level", "warning", "--model.enable-auto-tool-choice", "--model.tool-call-parser", "hermes")
        server = EmbeddedServer(model, Path(tmp) / "server", 32, None, tools)
        url = server.base_url + "/v1"
        try:
            renderer = {"name": "default", "tool_parser": "qwen3"} if args.env == "tool-calc" else None
            rows = [
                (f"v1 {path}", measure(sys.executable, args.env, url, model, args.groups, path, renderer))
                for path in ("direct", "verifiers")
            ]
            if CLASSIC_PY.exists() and args.env == "reverse-text":
                envs = str(ROOT / "tests" / "integration" / "classic_envs")
                got = measure(str(CLASSIC_PY), "reverse-classic", url, model, args.groups, "", None, envs)
                rows.append(("classic (.venv-classic)", got))
        finally:
            server.stop()
    n = args.groups * 8
    print(f"{n} rollouts of {args.env} (16 tokens per turn) per round, second round:")
    print(
        f"{'path':<24} {'wall s':>7} {'CPU s':>7} {'CPU ms/rollout':>15} {'turns':>6} {'CPU ms/turn':>12} {'errors':>7}"
    )
    for name, r in rows:
        per_turn = 1000 * r["cpu"] / max(r["turns"], 1)
        print(
            f"{name:<24} {r['wall']:>7.2f} {r['cpu']:>7.2f} {1000 * r['cpu'] / n:>15.2f} {r['turns']:>6} "
            f"{per_turn:>12.2f} {r['errors']:>7}"
        )


if __name__ == "__main__":
    main()
