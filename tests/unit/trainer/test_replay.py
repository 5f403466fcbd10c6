"""Routing replay (R3): the embedded engine records the experts it routed each token to, and the trainer's forward
replays them, so the trainer's logprobs come from the experts that sampled, even where the two route differently."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from asyncrl.config.inference import InferenceConfig
from asyncrl.core.errors import UserError
from asyncrl.inference.api.backend import SamplingParams
from asyncrl.inference.engine import EmbeddedEngine
from asyncrl.trainer.replay import RouterReplay, scoring_positions


def build_moe(path, near_tie: bool):
    """A tiny Qwen3-MoE (2 layers, 8 experts, top-2); `near_tie`: every router row equal up to 1e-8, so which
    expert wins is decided by float rounding, which differs between the engine's forwards and the trainer's."""
    from asyncrl.utils.tiny_model import build_tiny_model

    build_tiny_model(path, hidden_size=64, num_layers=2, experts=8, experts_per_token=2)
    if near_tie:
        weights = next(path.glob("*.safetensors"))
        tensors, gen = load_file(weights), torch.Generator().manual_seed(0)
        for name, w in tensors.items():
            if name.endswith("mlp.gate.weight"):
                tensors[name] = w[:1] + 1e-8 * torch.randn(w.shape, generator=gen)
        save_file(tensors, weights, metadata={"format": "pt"})
    return path


def engine_samples(model_dir) -> list[tuple[list[int], list[int], list[float], torch.Tensor]]:
    """(prompt, completion, sampling logprobs, routes) of 6 prompts x 3 sampled together, twice (the second wave
    reuses the first's prefixes), prompts sharing a 40-token header: fan-out, shared prefill, row compaction."""
    cfg = InferenceConfig(
        model={"name": str(model_dir)}, enable_return_routed_experts=True, num_threads=torch.get_num_threads()
    )
    engine, rng = EmbeddedEngine(cfg), random.Random(0)
    header = [rng.randrange(256) for _ in range(40)]
    prompts = [header + [rng.randrange(256) for _ in range(rng.randrange(3, 20))] for _ in range(6)]

    async def one(prompt):
        params = SamplingParams(max_tokens=8, n=3, temperature=1.0, logprobs=0)
        return [
            (prompt, d.token_ids, d.logprobs, d.routed_experts)
            async for d in engine.generate(prompt, params, stream=False)
        ]

    async def run():
        await engine.start()
        try:
            return [s for _ in range(2) for group in await asyncio.gather(*map(one, prompts)) for s in group]
        finally:
            await engine.shutdown()

    return [(p, c, lps, torch.from_numpy(r).long()) for p, c, lps, r in asyncio.run(run())]


def trainer_forward(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts each MoE block used ([tokens, layers, top_k]) and the logits of a full forward of `ids`."""
    used = []
    hooks = [m.register_forward_pre_hook(lambda _m, a: used.append(a[1])) for n, m in model.named_modules()]
    hooks = [h for h, (n, _) in zip(hooks, model.named_modules()) if n.endswith("mlp.experts") or h.remove()]
    try:
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(used, 1), logits


def completion_logprobs(logits: torch.Tensor, prompt: list[int], completion: list[int]) -> torch.Tensor:
    return logits[len(prompt) - 1 : -1].log_softmax(-1).gather(1, torch.tensor(completion)[:, None])[:, 0]


def same_sets(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.sort(-1).values == b.sort(-1).values).all(-1)


def load(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


@pytest.fixture(scope="module")
def near_tie_dir(tmp_path_factory):
    return build_moe(tmp_path_factory.mktemp("tie"), near_tie=True)


@pytest.fixture(scope="module")
def near_tie(near_tie_dir):
    """The near-tie model's engine samples, and a fresh trainer-side copy of it per test."""
    return engine_samples(near_tie_dir), near_tie_dir


def test_the_engine_records_the_experts_a_full_forward_routes_to(tmp_path):
    """Every token of every sample (prompt and completion, each layer), however the engine computed its KV."""
    model_dir = build_moe(tmp_path, near_tie=False)
    samples, model = engine_samples(model_dir), load(model_dir)
    for prompt, completion, _, routes in samples:
        assert routes.shape == (len(prompt) + len(completion) - 1, 2, 2)  # the last token was never forwarded
        with torch.no_grad():
            used, _ = trainer_forward(model, prompt + completion)
        assert same_sets(used[:-1], routes).all()


def test_replay_makes_the_trainers_routing_the_engines(near_tie):
    samples, model = near_tie[0], load(near_tie[1])
    own_differs, gaps = 0, []
    with torch.no_grad():
        for prompt, completion, lps, routes in samples:  # without replay: near ties go either way
            used, logits = trainer_forward(model, prompt + completion)
            own_differs += int((~same_sets(used[:-1], routes)).sum())
            gaps.append((completion_logprobs(logits, prompt, completion) - torch.tensor(lps)).abs().max())
    assert own_differs > 0 and max(gaps) > 1e-3
    replay = RouterReplay(model)
    with torch.no_grad():
        for prompt, completion, lps, routes in samples:
            record = torch.cat([routes, routes[-1:]]).to(torch.uint8)[None]  # the last token: a copy (no loss)
            replay.set(record, torch.ones(1, len(prompt) + len(completion), dtype=torch.bool))
            used, logits = trainer_forward(model, prompt + completion)
            assert torch.equal(used[:-1], routes)
            gap = (completion_logprobs(logits, prompt, completion) - torch.tensor(lps)).abs().max()
            assert gap < 1e-4, gap
    assert replay.take()["moe/replay_agreement"] < 1.0  # it counted the tokens its own router sent elsewhere
    assert replay.take() == {}


def test_the_router_still_learns_under_replay(near_tie):
    samples, model = near_tie[0], load(near_tie[1])
    prompt, completion, _, routes = samples[0]
    replay = RouterReplay(model)
    replay.set(torch.cat([routes, routes[-1:]]).to(torch.uint8)[None], torch.ones(1, len(routes) + 1, dtype=torch.bool))
    model.zero_grad()
    logits = model(input_ids=torch.tensor([prompt + completion]), use_cache=False).logits[0]
    completion_logprobs(logits, prompt, completion).sum().backward()
    gates = [p.grad for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")]
    assert len(gates) == 2 and all(g is not None and g.abs().sum() > 0 for g in gates)


def test_a_forward_whose_tokens_do_not_match_the_record_is_an_error(near_tie_dir):
    model = load(near_tie_dir)
    replay = RouterReplay(model)
    replay.set(torch.zeros(1, 5, 2, 2, dtype=torch.uint8), torch.ones(1, 5, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="layer 0 routes 6 tokens, the record has 5"):
        model(input_ids=torch.zeros(1, 6, dtype=torch.long), use_cache=False)
    with pytest.raises(RuntimeError, match="without routing records"):
        replay.set(None, torch.ones(1, 5, dtype=torch.bool))
    replay.close()
    assert model(input_ids=torch.zeros(1, 6, dtype=torch.long), use_cache=False).logits.shape[1] == 6


def test_replay_on_a_dense_model_is_a_one_line_error(tiny_model):
    with pytest.raises(UserError, match="tiny is not a mixture of experts.*router_replay = false"):
        RouterReplay(tiny_model, "tiny")


def test_the_agreement_counts_the_positions_whose_logits_score_a_loss_token():
    loss_mask = torch.tensor([[False, False, True, True, False]])
    assert scoring_positions(loss_mask, None).tolist() == [[False, True, True, False, False]]
    parents = torch.tensor([[-1, 0, 1, 1, 3]])  # a continuation: token 3's logits come from position 1
    mask = torch.tensor([[False, False, False, True, True]])
    assert scoring_positions(mask, parents).tolist() == [[False, True, False, True, False]]
