"""Orchestrator CPU per rollout: verifiers v1 episodes (.venv) against classic rollouts (.venv-classic).

Starts an embedded-engine server on a tiny model, then runs `--groups` groups of 8 reverse-text rollouts
(16 tokens each) through the orchestrator's own runners, twice (the first round warms up), and prints the
second round's wall time and this process's CPU time per rollout: v1 (`reverse-text`, a v1 taskset, the
`asyncrl-chat` harness) in this interpreter, classic (`tests/integration/classic_envs/reverse_classic`,
verifiers 0.3's token client, groups merged into one request) in `.venv-classic` when it exists
(`bash scripts/setup.sh --classic`).

    .venv/bin/python benchmarks/episodes.py [--groups 16]
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
from asyncrl.orchestrator.envs import EnvMixture, group_inputs, runners_for, sampling_args

env_id, url, model, groups = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
os.environ.setdefault("BENCH_KEY", "unused")
mixture = EnvMixture.load([EnvConfig(id=env_id)], seq_len=None)
slot = mixture.slots[0]
runners = runners_for(mixture.slots, ClientConfig(base_url=url, api_key_var="BENCH_KEY"), model, model)
args = sampling_args(SamplingConfig(max_tokens=16))

async def main():
    rounds = []
    for _ in range(2):
        wall, cpu = time.time(), time.process_time()
        runs = (runners.run_group(slot, group_inputs(slot.rows[i], 8), args) for i in range(groups))
        outs = await asyncio.gather(*runs)
        errors = sum(1 for g in outs for o in g if o.get("error"))
        rounds.append((time.time() - wall, time.process_time() - cpu, errors))
    await runners.close()
    return rounds[-1]

wall, cpu, errors = asyncio.run(main())
print(json.dumps({"wall": wall, "cpu": cpu, "errors": errors}))
"""


def measure(python: str, env_id: str, url: str, model: Path, groups: int, pythonpath: str = "") -> dict:
    env = {**os.environ, "PYTHONPATH": pythonpath} if pythonpath else dict(os.environ)
    cmd = [python, "-c", ROUND, env_id, url, str(model), str(groups)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"{env_id}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=16, help="groups of 8 rollouts per round")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "tests" / "integration"))
    from server_proc import ServerProcess  # the test suite's server launcher (embedded engine)

    from asyncrl.utils.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "model")
        (Path(tmp) / "server").mkdir()
        server = ServerProcess(model, Path(tmp) / "server")
        try:
            rows = [("verifiers v1 (.venv)", measure(sys.executable, "reverse-text", server.url, model, args.groups))]
            if CLASSIC_PY.exists():
                envs = str(ROOT / "tests" / "integration" / "classic_envs")
                got = measure(str(CLASSIC_PY), "reverse-classic", server.url, model, args.groups, envs)
                rows.append(("classic (.venv-classic)", got))
        finally:
            server.stop()
    n = args.groups * 8
    print(f"{n} rollouts of reverse-text (16 tokens) per round, second round:")
    print(f"{'path':<26} {'wall s':>7} {'CPU s':>7} {'CPU ms/rollout':>15} {'errors':>7}")
    for name, r in rows:
        print(f"{name:<26} {r['wall']:>7.2f} {r['cpu']:>7.2f} {1000 * r['cpu'] / n:>15.1f} {r['errors']:>7}")


if __name__ == "__main__":
    main()
