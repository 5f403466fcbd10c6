"""The embedded engine's batching shortcuts give what plain one-at-a-time computation gives: prompts sharing a
prefix, prefill forwards capped on CPU, grouped-KV attention, row compaction, the fast detokenizer."""

import asyncio
import types

import torch

from asyncrl.config.inference import InferenceConfig
from asyncrl.inference.api.backend import SamplingParams
from asyncrl.inference.engine import EmbeddedEngine
from asyncrl.inference.engine.engine import CPU_FORWARD_TOKENS
from asyncrl.inference.engine.kv_cache import SlotKVCache
from asyncrl.inference.engine.prefix_cache import shared_prefix_groups


def make_engine(model_dir, **kw) -> EmbeddedEngine:
    kw.setdefault("num_threads", torch.get_num_threads())  # leave the test process's setting alone
    return EmbeddedEngine(InferenceConfig(model={"name": str(model_dir)}, **kw))


async def collect(engine, prompt, params):
    ids, lps = [], []
    async for d in engine.generate(prompt, params):
        ids += d.token_ids
        lps += d.logprobs
    return ids, lps


def run_together(engine, prompts, params):
    """All prompts queued before the engine starts, so they are admitted (and prefilled) together."""

    async def main():
        streams = [collect(engine, p, params) for p in prompts]
        tasks = [asyncio.ensure_future(s) for s in streams]
        await asyncio.sleep(0)  # each task queues its request
        await engine.start()
        try:
            return await asyncio.gather(*tasks)
        finally:
            await engine.shutdown()

    return asyncio.run(main())


def run_alone(engine, prompts, params):
    async def main():
        await engine.start()
        try:
            return [await collect(engine, p, params) for p in prompts]
        finally:
            await engine.shutdown()

    return asyncio.run(main())


def test_distinct_prompts_sharing_a_prefix_equal_each_alone(tiny_model_dir):
    """40 distinct prompts after one 12-token header, admitted together: the header is prefilled once, the rests
    in forwards of at most forward_tokens, and every greedy token and logprob is what the prompt gets alone."""
    header = list(range(40, 52))
    prompts = [header + [60 + i % 7] + list(range(70 + i, 70 + i + 5 + i % 23)) for i in range(40)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine = make_engine(tiny_model_dir, max_prefill_tokens=8192)
    assert engine.forward_tokens == CPU_FORWARD_TOKENS  # the CPU cap, under the admission budget
    batches, extends = [], []
    prefill_batch, extend = engine._prefill_batch, engine._extend

    def counting_batch(reqs, rows, batch, *rest):
        widths = [len(reqs[j].prompt_ids) - start for j, start in batch]
        batches.append(([start for _, start in batch], len(batch) * max(widths)))
        return prefill_batch(reqs, rows, batch, *rest)

    def counting_extend(piece, *rest, **kw):
        extends.append(len(piece))
        return extend(piece, *rest, **kw)

    engine._prefill_batch, engine._extend = counting_batch, counting_extend
    together = run_together(engine, prompts, params)
    assert extends == [12]  # one forward of the shared header
    assert sorted(s for starts, _ in batches for s in starts) == [12] * 40
    assert len(batches) > 1 and all(tokens <= engine.forward_tokens for _, tokens in batches)

    alone = run_alone(make_engine(tiny_model_dir), prompts, params)
    for (ids, lps), (ref_ids, ref_lps) in zip(together, alone):
        assert ids == ref_ids
        assert torch.allclose(torch.tensor(lps), torch.tensor(ref_lps), atol=1e-5)


def test_shared_prefix_groups():
    base, other = list(range(20)), [99] + list(range(19))
    keys = [
        (False, "", base + [1, 2]),
        (False, "", base[:10]),  # shortest member: the group shares at most 9 tokens
        (True, "lora", base + [3]),  # another adapter: never grouped with the base model's prompts
        (False, "", base + [4, 5, 6]),
        (False, "", other + [7]),  # shares nothing with the rest
        (False, "", other + [8]),
    ]
    assert shared_prefix_groups(keys, 8, 1) == [([1, 0, 3], 9), ([4, 5], 20)]
    assert shared_prefix_groups(keys, 8, 18) == [([1, 0, 3], 9), ([4, 5], 20)]
    assert shared_prefix_groups(keys, 8, 19) == [([4, 5], 20)]  # (3 - 1) * 9 saves too little
    assert shared_prefix_groups(keys, 10, 1) == [([4, 5], 20)]  # 9 < min_tokens
    assert shared_prefix_groups([], 8, 1) == []


def test_gqa_attention_equals_hf_sdpa():
    """The CPU attention reads grouped KV heads in place and gives HF sdpa's output exactly (decode and prefill
    shapes, boolean masks, non-contiguous cache views)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from asyncrl.inference.engine.attention import gqa_sdpa_forward

    module = types.SimpleNamespace(num_key_value_groups=2, is_causal=True)
    torch.manual_seed(0)
    for batch, q_len, kv_len in ((5, 1, 9), (3, 7, 7)):
        query = torch.randn(batch, 4, q_len, 8)
        key, value = (torch.randn(batch, 2, 16, 8)[:, :, :kv_len] for _ in range(2))
        mask = torch.rand(batch, 1, q_len, kv_len) > 0.3
        mask[..., 0] = True
        ours, _ = gqa_sdpa_forward(module, query, key, value, mask, scaling=0.3)
        ref, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
        assert torch.equal(ours, ref)


def test_engine_on_cpu_uses_the_gqa_attention(tiny_model_dir):
    from asyncrl.inference.engine.attention import NAME

    assert make_engine(tiny_model_dir).model.config._attn_implementation == NAME


def test_removing_rows_moves_the_last_rows_into_the_holes():
    """Rows 2 and 8 of 10 finish: row 9 fills row 8 and then moves on to row 2 (a chained move), row 8's
    own sequence is gone; one copy per buffer, and the survivors' KV is where their sequences are."""
    cache = SlotKVCache(1, torch.float32, torch.device("cpu"))
    cache.ensure(10, 4)
    cache.keys = [torch.arange(10.0)[:, None, None, None].expand(10, 1, cache.capacity, 2).clone()]
    cache.values = [cache.keys[0] + 100]
    active = [types.SimpleNamespace(name=i, seq=types.SimpleNamespace(length=3)) for i in range(10)]
    engine = types.SimpleNamespace(_active=active, cache=cache)
    EmbeddedEngine._remove_rows(engine, [2, 8])
    assert [a.name for a in engine._active] == [0, 1, 9, 3, 4, 5, 6, 7]
    assert cache.keys[0][:8, 0, :3, 0][:, 0].tolist() == [0, 1, 9, 3, 4, 5, 6, 7]
    assert cache.values[0][2, 0, :3, 1].tolist() == [109.0] * 3


def test_fast_decode_gives_the_tokenizers_text(tiny_model_dir):
    from transformers import AutoTokenizer

    from asyncrl.inference.engine.sequence import FastDecode

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    fast = FastDecode(tok)
    assert fast.decode != tok.decode  # the tiny tokenizer takes the fast path
    special = tok.convert_tokens_to_ids("<|im_end|>")
    cases = [list(b"hello world"), [*"é".encode(), special, 32], [0xE2, 0x82], [special]]  # a split character
    for ids in cases:
        for skip in (True, False):
            assert fast.decode(ids, skip_special_tokens=skip) == tok.decode(ids, skip_special_tokens=skip)
