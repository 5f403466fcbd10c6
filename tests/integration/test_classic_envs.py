"""Classic verifiers environments (`load_environment`, verifiers < 0.4) keep working where that verifiers is installed.

The project's `.venv` has verifiers 0.4 (v1 only); `scripts/setup.sh --classic` makes `.venv-classic` with
verifiers 0.3 (scripts/test.sh does, before the suite). These tests run asyncrl *in that interpreter*, as a user
with classic environments would, against `classic_envs/reverse_classic` (the classic reverse-text asyncrl shipped
before its v1 port): the classic path loads it, rolls it out through verifiers' token client with the engine's
tokens and logprobs, and `rl` trains it. Shared servers and the warm model come from this (main) session.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from asyncrl.utils.process import free_port
from tests.integration.test_rl import orchestrator_rows, reward_rise, rl_args  # the demo run, as test_rl runs it

REPO = Path(__file__).resolve().parents[2]
CLASSIC_PY = REPO / ".venv-classic" / "bin" / "python"
CLASSIC_ENVS = Path(__file__).resolve().parent / "classic_envs"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not CLASSIC_PY.exists(), reason="no .venv-classic: run `bash scripts/setup.sh --classic`"),
]


def classic(args: list[str], timeout: float = 600, **kwargs) -> subprocess.CompletedProcess:
    """Run `python args...` in the classic environment, the test's classic environments importable."""
    env = {**os.environ, "PYTHONPATH": str(CLASSIC_ENVS), "CLASSIC_TEST_KEY": "classic-secret"}
    return subprocess.run([str(CLASSIC_PY), *args], capture_output=True, text=True, timeout=timeout, env=env, **kwargs)


ROLLOUTS = """
import asyncio, json, sys
import verifiers
from asyncrl.config.orchestrator import ClientConfig, EnvConfig, SamplingConfig
from asyncrl.orchestrator.envs.mixture import EnvMixture, group_inputs
from asyncrl.orchestrator.envs.runners import runners_for, sampling_args
from asyncrl.orchestrator.samples import TrajectoryConverter

url, model = sys.argv[1:]
mixture = EnvMixture.load([EnvConfig(id="reverse-classic", args={"num_train_examples": 4})], seq_len=None)
slot = mixture.slots[0]
# ignore_eos: this tiny model often ends its reply at once, and verifiers 0.3 fails an empty reply
# (EmptyModelResponseError); every rollout here is to come back whole, so each samples its 8 tokens.
SAMPLING = SamplingConfig(max_tokens=8, extra_body={"ignore_eos": True})
runners = runners_for(mixture.slots, ClientConfig(base_url=url, api_key_var="CLASSIC_TEST_KEY"), model, model)

async def main():
    try:
        return await runners.run_group(slot, group_inputs(slot.rows[0], 3), sampling_args(SAMPLING))
    finally:
        await runners.close()

outputs = asyncio.run(main())
rollouts = [TrajectoryConverter().convert(o, slot.name) for o in outputs]
print(json.dumps({
    "verifiers": verifiers.__version__,
    "env": type(slot.env).__name__,
    "pool": type(runners.classic_client.client._client).__name__,
    "key": runners.classic_client.client.api_key,
    "rows": [sorted(r) for r in slot.rows[:1]],
    "rollouts": [
        {"ok": r.ok, "error": r.error, "reward": r.reward, "samples": [
            {"ids": len(s.input_ids), "trained": sum(s.loss_mask), "logprobs": sum(1 for x in s.logprobs if x)}
            for s in r.samples
        ]}
        for r in rollouts
    ],
}))
"""


def test_a_classic_environment_rolls_out_through_the_classic_token_client(shared_inference_process):
    done = classic(["-c", ROLLOUTS, shared_inference_process.url, str(shared_inference_process.model)])
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.splitlines()[-1])
    assert got["verifiers"].startswith("0.3") and got["env"] == "SingleTurnEnv"
    assert "aiohttp" in got["pool"].lower()  # our pool, not verifiers' httpx default
    assert got["key"] == "classic-secret"  # from the variable api_key_var names
    assert "answer" in got["rows"][0] and "example_id" in got["rows"][0]  # classic rows are dataset dicts
    assert len(got["rollouts"]) == 3
    for rollout in got["rollouts"]:
        assert rollout["ok"], rollout["error"]
        (sample,) = rollout["samples"]
        assert sample["trained"] == 8 and sample["ids"] > sample["trained"]  # ignore_eos: all 8
        assert sample["logprobs"] >= sample["trained"] - 1  # the engine's logprobs on the sampled tokens


MERGE = """
import asyncio, json, sys
from asyncrl.config.orchestrator import ClientConfig, EnvConfig
from asyncrl.orchestrator.envs.classic import make_vf_client
from asyncrl.orchestrator.envs.mixture import EnvMixture, group_inputs
from asyncrl.orchestrator.envs.runners import verifiers_run_group

url, model = sys.argv[1:]
mixture = EnvMixture.load([EnvConfig(id="reverse-classic", args={"num_train_examples": 4})], seq_len=None)

async def go(merge):
    client = make_vf_client(ClientConfig(base_url=url, merge_requests=merge))
    try:
        slot, row = mixture.draw()
        sampling = {"temperature": 1.0, "max_tokens": 16}
        outputs = await verifiers_run_group(model, client)(slot, group_inputs(row, 16), sampling)
        return outputs, client.client._client._transport
    finally:
        await client.close()

outputs, transport = asyncio.run(go(True))
steps = [o["trajectory"][0]["tokens"] for o in outputs if o["trajectory"]]
_, plain = asyncio.run(go(False))
print(json.dumps({
    "sent": transport.sent, "merged": transport.merged, "outputs": len(outputs),
    "prompts": len({tuple(s["prompt_ids"]) for s in steps}),
    "logprobs_match": all(len(s["completion_logprobs"]) == len(s["completion_ids"]) > 0 for s in steps),
    "steps": len(steps), "plain_merges": hasattr(plain, "merged"),
}))
"""


def test_a_classic_group_goes_out_as_one_request_and_each_rollout_keeps_its_own_answer(shared_inference_process):
    """verifiers' classic client sends a group's rollouts as separate identical requests; ours merges them
    into one n = 16 request, and every rollout gets an answer of its own with token ids and logprobs."""
    done = classic(["-c", MERGE, shared_inference_process.url, str(shared_inference_process.model)])
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.splitlines()[-1])
    assert (got["sent"], got["merged"], got["outputs"]) == (1, 16, 16)
    # this tiny model often answers with <|im_end|> at once, which verifiers rejects (no trajectory)
    assert got["steps"] and got["prompts"] == 1 and got["logprobs_match"]
    assert not got["plain_merges"]  # merge_requests = false: the client's own transport, untouched


def test_a_v1_only_verifiers_names_a_classic_environment_and_the_way_out():
    """Under the main .venv (verifiers 0.4) the same package is refused in one line, saying what to do."""
    import sys

    from asyncrl.config.orchestrator import EnvConfig
    from asyncrl.core.errors import UserError
    from asyncrl.orchestrator.envs.loading import load_env

    sys.path.insert(0, str(CLASSIC_ENVS))
    try:
        with pytest.raises(UserError, match="not a verifiers v1 environment.*verifiers<0.4"):
            load_env(EnvConfig(id="reverse-classic"))
    finally:
        sys.path.remove(str(CLASSIC_ENVS))


def test_rl_trains_a_classic_environment(warm_model, tmp_path):
    """The demo's run (warm model, 40 steps) on the classic environment, every process in .venv-classic.

    The rise of the mean reward (last 5 steps minus first 5) has a measured band: 30 runs of this run
    (benchmarks/learning_bands.py --tests classic --at 40, 2026-12-01, 2-core CPU): +0.092 ± 0.013 at 40 steps,
    lowest +0.066, 1st percentile +0.061; the threshold (0.05) is below it."""
    out, steps = tmp_path / "run", 40
    config = tmp_path / "rl.toml"
    config.write_text('[[orchestrator.env]]\nid = "reverse-classic"\n')
    args = ["-m", "asyncrl.entrypoints.rl", "@", str(config), *rl_args(warm_model, out, steps, free_port())]
    done = classic(args, cwd=REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = orchestrator_rows(out)
    assert [r["step"] for r in rows] == list(range(steps))
    assert reward_rise(rows) > 0.05, [round(r["reward/mean"], 3) for r in rows]
