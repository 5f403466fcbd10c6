"""The engine's own forward against HF's: the same logits and cache writes, bit for bit, per architecture and mode."""

from __future__ import annotations

import pytest
import torch

from asyncrl.inference.engine.attention import use_gqa_sdpa
from asyncrl.inference.engine.dense_forward import DenseForward, why_not
from asyncrl.inference.engine.kv_cache import MaskBuilder, SlotKVCache

CPU = torch.device("cpu")


def small(model_type: str, **extra):
    """A random-init model of `model_type` (hidden 64, 2 layers, grouped KV heads), on HF's sdpa then ours."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
    fields |= dict(num_key_value_heads=2, vocab_size=300, max_position_embeddings=256, **extra)
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **fields)
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config).eval()
    assert use_gqa_sdpa(model, CPU)
    return model


def twin_caches(model, rows: int) -> tuple[SlotKVCache, SlotKVCache]:
    """Two caches with the same random history: one for our forward, one for HF's."""
    ours, theirs = cache_with_history(model, rows, 128), cache_with_history(model, rows, 128)
    theirs.keys, theirs.values = [k.clone() for k in ours.keys], [v.clone() for v in ours.values]
    return ours, theirs


def cache_with_history(model, rows: int, capacity: int) -> SlotKVCache:
    cfg = model.config
    cache = SlotKVCache(cfg.num_hidden_layers, torch.float32, CPU)
    cache.ensure(rows + 3, capacity)  # spare slots past the active rows, as in the engine
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    shape = (cache.slots, cfg.num_key_value_heads, cache.capacity, head_dim)
    cache.keys = [torch.randn(shape) for _ in range(cfg.num_hidden_layers)]
    cache.values = [torch.randn(shape) for _ in range(cfg.num_hidden_layers)]
    return cache


def hf_step(model, cache, tokens, positions, kv_len, mask):
    cache.set_decode(len(tokens), positions, kv_len)
    out = model(input_ids=tokens[:, None], position_ids=positions[:, None], attention_mask=mask,
                past_key_values=cache, use_cache=True)  # fmt: skip
    return out.logits[:, -1]


@pytest.mark.parametrize(
    "model_type, extra",
    [
        ("qwen3", {"head_dim": 16}),
        ("qwen2", {}),  # biases on q, k, v
        ("llama", {"attention_bias": True, "mlp_bias": True}),
        ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0}}),
    ],
)  # fmt: skip
def test_decode_steps_are_hf_forward_bit_for_bit(model_type, extra):
    model = small(model_type, **extra)
    assert why_not(model) is None
    decoder = DenseForward.for_model(model, CPU)
    rows = 5
    positions = torch.tensor([3, 40, 17, 99, 0])  # rows of different lengths share the step
    kv_len = int(positions.max()) + 1
    tokens = torch.randint(0, 300, (rows,))
    masks = MaskBuilder(model.config, torch.float32)
    with torch.inference_mode():
        for _ in range(2):  # the second step reads the keys the first wrote
            ours, theirs = twin_caches(model, rows)
            mask = masks.decode(positions, kv_len)
            expected = hf_step(model, theirs, tokens, positions, kv_len, mask)
            ours.set_decode(rows, positions, kv_len)
            got = decoder.forward(tokens[:, None], positions[:, None], mask, ours, last_only=True)
            assert torch.equal(got[:, -1], expected)
            assert all(torch.equal(a, b) for a, b in zip(ours.keys + ours.values, theirs.keys + theirs.values))
            positions, tokens = positions + 1, expected.argmax(-1)
            kv_len += 1


def test_models_it_does_not_compute_keep_hf_forward():
    assert "sliding-window" in why_not(small("qwen3", layer_types=["sliding_attention", "full_attention"],
                                             use_sliding_window=True, sliding_window=8))  # fmt: skip
    assert "model type 'mistral'" in why_not(small("mistral"))
    eager = small("qwen3")
    eager.set_attn_implementation("eager")
    assert "attention 'eager'" in why_not(eager)
    assert DenseForward.for_model(small("qwen3"), torch.device("cuda")) is None  # CPU only


def test_a_left_padded_prefill_is_hf_forward_bit_for_bit():
    model = small("qwen3", head_dim=16)
    decoder = DenseForward.for_model(model, CPU)
    pads, width = torch.tensor([0, 3, 5]), 9
    ids = torch.randint(0, 300, (3, width))
    positions = (torch.arange(width)[None, :] - pads[:, None]).clamp(min=0)
    mask = MaskBuilder(model.config, torch.float32).prefill(pads, width)
    with torch.inference_mode():
        ours, theirs = twin_caches(model, 3)
        for cache in (ours, theirs):
            cache.set_prefill(torch.tensor([2, 0, 1]), pads, width)
        expected = model(input_ids=ids, position_ids=positions, attention_mask=mask, past_key_values=theirs,
                         use_cache=True).logits  # fmt: skip
        got = decoder.forward(ids, positions, mask, ours, last_only=False)
        assert torch.equal(got, expected)
        theirs.set_prefill(torch.tensor([2, 0, 1]), pads, width)  # the same writes again, then the last logits
        last = model(input_ids=ids, position_ids=positions, attention_mask=mask, past_key_values=theirs,
                     use_cache=True, logits_to_keep=1).logits  # fmt: skip
        ours.set_prefill(torch.tensor([2, 0, 1]), pads, width)
        assert torch.equal(decoder.forward(ids, positions, mask, ours, last_only=True), last)
        assert all(torch.equal(a, b) for a, b in zip(ours.keys + ours.values, theirs.keys + theirs.values))


def test_the_engine_gives_what_it_gives_with_hf_forward(tiny_model_dir):
    """Seeded sampling with rows joining and leaving, chunked prompts (extend), prompts over a cached prefix
    (a second turn), n > 1 and a scoring request: the same tokens and logprobs with either forward."""
    import asyncio

    from asyncrl.inference.api.backend import SamplingParams
    from tests.unit.inference.test_engine import make_engine

    prompts = [list(range(60, 60 + k)) for k in (3, 17, 9, 30)]
    specs = [(0.7, 2, 12), (1.0, 1, 5), (1.3, 3, 9), (1.0, 1, 4)]

    def run(fast: bool):
        engine = make_engine(tiny_model_dir, max_batch_size=8, max_prefill_tokens=16)  # 17, 30: chunked
        assert engine.dense is not None  # the tests' tiny Qwen3
        engine.dense = engine.dense if fast else None

        def params(t, n, m, seed):
            return SamplingParams(max_tokens=m, temperature=t, n=n, seed=seed, ignore_eos=True, logprobs=2)

        async def collect(prompt, p):  # every delta whole: tokens, logprobs, top logprobs, prompt logprobs
            return [d async for d in engine.generate(prompt, p)]

        async def main():
            await engine.start()
            try:
                first = await asyncio.gather(*[collect(p, params(*s, 7)) for p, s in zip(prompts, specs)])
                turns = [p + c[0].token_ids + [70, 71] for p, c in zip(prompts, first)]  # over the cached prefix
                second = await asyncio.gather(*[collect(p, params(*s, 8)) for p, s in zip(turns, specs)])
                scored = SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0)
                return first, second, await collect(turns[1], scored)
            finally:
                await engine.shutdown()

        return asyncio.run(main())

    assert run(fast=True) == run(fast=False)
