"""verifiers v1 against our server (issue 27, first brick): an episode of a v1 taskset runs through verifiers'
own training client (renderers' `generate` -> our `/inference/v1/generate`), and the token ids and logprobs
on its trace are the ones the embedded engine sampled: the HF forward of the same ids gives the same logprobs.

The taskset is `v1_envs/reverse_v1` (local tasks). Harness `null`, runtime `subprocess`: the model is called
from this process, no sandbox.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow
sys.path.insert(0, str(Path(__file__).resolve().parent / "v1_envs"))
vf = pytest.importorskip("verifiers.v1")


def run_episode(server, task_index: int, max_tokens: int = 8):
    from verifiers.v1.envs.single_agent import SingleAgentEnvConfig
    from verifiers.v1.utils.loaders import load_environment

    config = SingleAgentEnvConfig.model_validate(
        {"taskset": {"id": "reverse_v1"}, "agent": {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}}}
    )
    env = load_environment(config)
    task = list(env.taskset)[task_index]
    client = vf.TrainClientConfig(
        base_url=server.url, api_key_var="ASYNCRL_TEST_V1_KEY", renderer_model_name=server.model
    )
    sampling = vf.Sampling(max_tokens=max_tokens, temperature=1.0)
    ctx = vf.ModelContext(model=server.model, client=client, sampling=sampling)
    return task, asyncio.run(env.run_episode(task, ctx))


def test_a_v1_episode_carries_the_engines_tokens_and_logprobs(shared_inference_process, monkeypatch):
    monkeypatch.setenv("ASYNCRL_TEST_V1_KEY", "unused")  # the server has no key; the client wants a variable
    task, episode = run_episode(shared_inference_process, 1)
    assert episode.ok and not episode.errors, episode.errors
    (trace,) = episode.traces
    assert trace.reward in (0.0, 1.0) and trace.num_turns == 1
    (branch,) = trace.branches
    ids, logprobs, sampled = branch.token_ids, branch.logprobs, branch.sampled_mask
    assert len(ids) == len(logprobs) == len(sampled)
    first = sampled.index(True)
    assert 1 <= sum(sampled) <= 8 and all(sampled[first:]) and not any(sampled[:first])

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(shared_inference_process.model, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    recomputed = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    served = torch.tensor(logprobs[1:])
    mask = torch.tensor(sampled[1:])
    assert torch.allclose(served[mask], recomputed[mask], atol=1e-4), (served[mask], recomputed[mask])
