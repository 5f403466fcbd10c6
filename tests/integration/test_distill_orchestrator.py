"""On-policy distillation end to end: the `orchestrator` runs 2 steps against the shared `inference` server (the
student, the tiny model) with a second embedded `inference` server as the teacher (another tiny model with the
same tokenizer, behind an API key). Every loss token's advantage in the written batches must be the teacher's
logprob of that token (a fresh transformers forward of the teacher) minus the sampler's, plus the position's
baseline (`distill.top_k` = 5: the reverse KL from both models' top 5, the student's scored by its own server);
the metrics carry the teacher KL. Skipped while our server does not answer `prompt_logprobs` (probed once)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import torch
from server_proc import serve_in_thread

from asyncrl.config.orchestrator import OrchestratorConfig
from asyncrl.transport.batch import read_batch
from asyncrl.transport.layout import RunLayout

pytestmark = pytest.mark.slow
KEY_VAR, KEY = "ASYNCRL_TEST_TEACHER_KEY", "teacher-key"


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """An embedded `inference` server serving a second tiny model (seed 1, same tokenizer), with an API key."""
    from asyncrl.config.inference import InferenceConfig
    from asyncrl.inference.api.app import create_app
    from asyncrl.inference.engine import EmbeddedEngine
    from asyncrl.utils.tiny_model import build_tiny_model

    model_dir = build_tiny_model(tmp_path_factory.mktemp("teacher"), hidden_size=128, num_layers=2, seed=1)
    config = InferenceConfig(model={"name": str(model_dir), "max_model_len": 1024}, api_key=KEY, num_threads=1)
    url, stop = serve_in_thread(create_app(EmbeddedEngine(config), config), 120)
    try:
        probe = httpx.post(
            f"{url}/v1/completions",
            headers={"Authorization": f"Bearer {KEY}"},
            json={"model": str(model_dir), "prompt": [1, 2, 3], "max_tokens": 1, "prompt_logprobs": 0},
            timeout=60,
        )
        answered = probe.status_code == 200 and isinstance(probe.json()["choices"][0].get("prompt_logprobs"), list)
        if not answered:
            pytest.skip(f"the inference server does not answer prompt_logprobs yet ({probe.status_code})")
        yield url + "/v1", model_dir
    finally:
        stop()


def test_two_distillation_steps_against_real_servers(shared_inference_process, teacher, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from asyncrl.orchestrator.process import orchestrate

    monkeypatch.setenv(KEY_VAR, KEY)
    teacher_url, teacher_dir = teacher
    config = OrchestratorConfig(
        model={"name": shared_inference_process.model},
        client={"base_url": shared_inference_process.url},
        teacher={"base_url": teacher_url, "api_key_var": KEY_VAR, "max_concurrent": 4},
        distill={"top_k": 5},
        env=[{"id": "reverse-text", "args": {"num_train_examples": 20, "num_eval_examples": 2}}],
        batch_size=4,
        rollouts_per_example=2,
        sampling={"max_tokens": 12},
        seq_len=256,
        max_steps=2,
        max_async_level=2,  # steps 0 and 1 use the base model: no trainer needed
        num_train_workers=1,
        output_dir=tmp_path,
    )
    asyncio.run(orchestrate(config, RunLayout.for_config(config)))

    model = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32)
    student = AutoModelForCausalLM.from_pretrained(shared_inference_process.model, dtype=torch.float32)
    records = [json.loads(line) for line in (tmp_path / "metrics" / "orchestrator.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    assert all(
        r["distill/teacher_kl"] != 0 and r["distill/teacher_lp"] < 0 and r["time/teacher_s"] >= 0 for r in records
    )
    samples, max_err = 0, 0.0
    for step in range(2):
        for packed in read_batch(RunLayout(tmp_path), step, 0):
            mb = packed.expanded()
            starts = (mb.position_ids == 0).nonzero().flatten().tolist() + [len(mb.input_ids)]
            for a, b in zip(starts, starts[1:]):
                ids, mask = mb.input_ids[a:b], mb.loss_mask[a:b]
                if not mask.any():
                    continue
                samples += 1
                t_dist, s_dist = (log_dists(m, ids) for m in (model, student))
                lp = torch.cat([torch.zeros(1), t_dist.gather(-1, ids[1:, None])[:, 0]])
                kl = torch.tensor(
                    [0.0] + [top_k_kl(s_dist[t], t_dist[t], int(ids[t + 1])) for t in range(len(ids) - 1)]
                )
                want = (lp - mb.inference_logprobs[a:b] + kl)[mask]
                max_err = max(max_err, (mb.advantages[a:b][mask] - want).abs().max().item())
                assert (mb.advantages[a:b][~mask] == 0).all()
    assert samples == 8 and max_err < 1e-3


def log_dists(model, ids: torch.Tensor) -> torch.Tensor:
    """[len(ids) - 1, V]: row t is the model's log-distribution of the token at position t + 1."""
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=ids[None]).logits[0, :-1].float(), -1)


def top_k_kl(s_row: torch.Tensor, t_row: torch.Tensor, token: int, k: int = 5) -> float:
    """The baseline at one position: over the student's top k and the token, s(x)(log s(x) - log t(x)), where a
    token outside the teacher's top k and the token takes the teacher's lowest listed logprob."""
    listed_s = set(s_row.topk(k).indices.tolist()) | {token}
    listed_t = set(t_row.topk(k).indices.tolist()) | {token}
    floor = min(t_row[x].item() for x in listed_t)
    return sum(
        s_row[x].exp().item() * (s_row[x].item() - (t_row[x].item() if x in listed_t else floor)) for x in listed_s
    )
