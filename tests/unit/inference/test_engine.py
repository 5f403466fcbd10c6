"""The embedded engine without HTTP: continuous batching, exact logprobs, queueing, aborts, budgets."""

import asyncio
import json

import pytest
import torch

from asyncrl.config.inference import InferenceConfig
from asyncrl.core.errors import UserError
from asyncrl.inference.api.backend import SamplingParams
from asyncrl.inference.api.errors import InvalidRequest
from asyncrl.inference.engine import EmbeddedEngine
from asyncrl.inference.engine.kv_cache import MaskBuilder, SlotKVCache


def make_engine(model_dir, **kw) -> EmbeddedEngine:
    kw.setdefault("num_threads", torch.get_num_threads())  # leave the test process's setting alone
    return EmbeddedEngine(InferenceConfig(model={"name": str(model_dir)}, **kw))


async def collect(engine, prompt, params):
    out: dict[int, dict] = {}
    async for d in engine.generate(prompt, params):
        o = out.setdefault(d.index, {"ids": [], "lps": [], "finish": None})
        o["ids"] += d.token_ids
        o["lps"] += d.logprobs
        o["finish"] = d.finish_reason or o["finish"]
    return [out[i] for i in sorted(out)]


def hf_logprobs(model, prompt, ids, temperature):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]
    return (logits / temperature).log_softmax(-1).gather(1, torch.tensor(ids)[:, None])[:, 0]


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def test_concurrent_mixed_requests_have_exact_logprobs(tiny_model_dir, hf_model):
    """Different prompt lengths (batched and chunked prefill), n, temperatures and max_tokens in one
    batch (rows join and leave)."""
    engine = make_engine(tiny_model_dir, max_batch_size=8, max_prefill_tokens=16)  # prompts of 17, 30: chunked
    prompts = [list(range(60, 60 + k)) for k in (3, 17, 9, 30, 1)]
    specs = [(0.7, 2, 12), (1.0, 1, 5), (1.3, 3, 9), (0.5, 1, 20), (1.0, 2, 7)]

    async def main():
        await engine.start()
        try:
            return await asyncio.gather(*[
                collect(engine, p, SamplingParams(max_tokens=m, temperature=t, n=n, ignore_eos=True))
                for p, (t, n, m) in zip(prompts, specs)
            ])  # fmt: skip
        finally:
            await engine.shutdown()

    results = asyncio.run(main())
    for prompt, (temp, n, max_tokens), choices in zip(prompts, specs, results):
        assert len(choices) == n
        for c in choices:
            assert len(c["ids"]) == max_tokens and c["finish"] == "length"
            ref = hf_logprobs(hf_model, prompt, c["ids"], temp)
            assert torch.allclose(torch.tensor(c["lps"]), ref, atol=1e-5)
    assert not engine._active


def test_repeated_prompts_prefill_once(tiny_model_dir, hf_model):
    """An RL group sent as separate requests: one prefill, every sample still exact."""
    engine = make_engine(tiny_model_dir)
    prefilled = []
    original = engine._prefill_batch

    def counting(reqs, rows, batch, *rest):
        prefilled.append(len(batch))
        return original(reqs, rows, batch, *rest)

    engine._prefill_batch = counting
    prompt = list(range(70, 90))

    async def drain(stream):
        out: dict[int, dict] = {}
        async for d in stream:
            o = out.setdefault(d.index, {"ids": [], "lps": []})
            o["ids"] += d.token_ids
            o["lps"] += d.logprobs
        return list(out.values())

    async def main():
        # queued before the engine runs, so they are admitted together
        streams = [engine.generate(prompt, SamplingParams(max_tokens=8, n=n, ignore_eos=True)) for n in (1, 2, 1, 3)]
        await engine.start()
        try:
            return await asyncio.gather(*[drain(s) for s in streams])
        finally:
            await engine.shutdown()

    results = asyncio.run(main())
    assert prefilled == [1]  # 4 requests, 7 samples, one prompt prefilled
    for choices in results:
        for c in choices:
            assert torch.allclose(torch.tensor(c["lps"]), hf_logprobs(hf_model, prompt, c["ids"], 1.0), atol=1e-5)


def test_prefix_cache_reuses_finished_kv_exactly(tiny_model_dir, hf_model, tmp_path):
    """A next turn (prompt = earlier prompt + its output + more) and a prompt sharing only a system-prompt
    prefix reuse the stored KV, compute only the rest, and still match HF; a weight swap clears it."""
    engine = make_engine(tiny_model_dir, max_prefill_tokens=16)  # the uncached rest goes in 16-token chunks
    system = list(range(40, 100))
    params = SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)

    async def main():
        await engine.start()
        try:
            [first] = await collect(engine, system + [5, 6, 7], params)
            turn2 = system + [5, 6, 7] + first["ids"] + [8, 9]
            [second] = await collect(engine, turn2, params)
            after_turn2 = (engine.prefix.hits, engine.prefix.reused_tokens)
            [other] = await collect(engine, system + [11, 12], params)  # shares the 60-token prefix only
            after_other = (engine.prefix.hits, engine.prefix.reused_tokens)
            await collect(engine, turn2 + second["ids"][:3], params)  # its best match is not the oldest entry
            assert engine.prefix.hits == 3
            await engine.reload_weights()
            assert engine.prefix.nbytes == 0
            await collect(engine, turn2, params)
            return first, turn2, second, after_turn2, other, after_other
        finally:
            await engine.shutdown()

    first, turn2, second, after_turn2, other, after_other = asyncio.run(main())
    assert after_turn2 == (1, len(system) + 3 + 10 - 1)  # all but the first turn's last token
    assert after_other == (2, after_turn2[1] + len(system))
    for prompt, c in ((turn2, second), (system + [11, 12], other)):
        assert torch.allclose(torch.tensor(c["lps"]), hf_logprobs(hf_model, prompt, c["ids"], 1.0), atol=1e-5)
    assert engine.prefix.hits == 3  # nothing reused after the weights changed

    off = make_engine(tiny_model_dir, prefix_cache_gb=0)

    async def twice():
        await off.start()
        try:
            for _ in range(2):
                await collect(off, system, params)
        finally:
            await off.shutdown()

    asyncio.run(twice())
    assert off.prefix.hits == 0


def test_queueing_beyond_batch_size_and_limits(tiny_model_dir):
    engine = make_engine(tiny_model_dir, max_batch_size=2, kv_cache_gb=0.001)

    async def main():
        await engine.start()
        try:
            outs = await asyncio.gather(*[
                collect(engine, [65 + i] * (i + 1), SamplingParams(max_tokens=6, ignore_eos=True)) for i in range(5)
            ])  # fmt: skip
            with pytest.raises(InvalidRequest, match="max_batch_size"):
                engine.generate([1], SamplingParams(max_tokens=2, n=3))
            with pytest.raises(InvalidRequest, match="KV cache"):
                engine.generate([1], SamplingParams(max_tokens=4000))
            with pytest.raises(InvalidRequest, match="LoRA"):
                engine.generate([1], SamplingParams(max_tokens=2), lora_name="nope")
            return outs
        finally:
            await engine.shutdown()

    outs = asyncio.run(main())
    assert all(len(o[0]["ids"]) == 6 for o in outs)


def test_kv_budget_limits_the_batch(tiny_model_dir):
    """A budget of two 128-position rows: five requests still all finish, never more than 2 at once."""
    engine = make_engine(tiny_model_dir, max_batch_size=8, kv_cache_gb=2 * 128 * 512 / 2**30)  # 512 B/token
    assert engine._bytes_per_token == 512
    peak = 0

    async def watch():
        nonlocal peak
        while True:
            peak = max(peak, len(engine._active))
            await asyncio.sleep(0)

    async def main():
        await engine.start()
        watcher = asyncio.ensure_future(watch())
        try:
            return await asyncio.gather(*[
                collect(engine, [65 + i, 66], SamplingParams(max_tokens=20, ignore_eos=True)) for i in range(5)
            ])  # fmt: skip
        finally:
            watcher.cancel()
            await engine.shutdown()

    outs = asyncio.run(main())
    assert all(len(o[0]["ids"]) == 20 for o in outs) and peak == 2


def test_closing_a_stream_aborts_the_request(tiny_model_dir):
    engine = make_engine(tiny_model_dir)

    async def main():
        await engine.start()
        try:
            stream = engine.generate([65, 66], SamplingParams(max_tokens=3000, ignore_eos=True))
            got = [await stream.__anext__() for _ in range(3)]
            await stream.aclose()
            for _ in range(200):
                if not engine._active and not engine._waiting:
                    break
                await asyncio.sleep(0.01)
            assert not engine._active
            # the engine keeps serving
            [c] = await collect(engine, [70], SamplingParams(max_tokens=3, ignore_eos=True))
            return got, c
        finally:
            await engine.shutdown()

    got, c = asyncio.run(main())
    assert all(d.finish_reason is None for d in got) and len(c["ids"]) == 3


def test_weight_dir_validation(tiny_model_dir, tmp_path):
    from asyncrl.utils.tiny_model import build_tiny_model

    engine = make_engine(tiny_model_dir)
    other = build_tiny_model(tmp_path / "other", hidden_size=32, num_layers=2)

    async def main():
        await engine.start()
        try:
            for bad in (tmp_path / "missing", other, tmp_path):
                with pytest.raises(InvalidRequest):
                    await engine.update_weights(str(bad))
            await engine.update_weights(str(tiny_model_dir))
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_lora_adapter_validation(tiny_model_dir, tmp_path):
    from safetensors.torch import save_file

    engine = make_engine(tiny_model_dir)
    adapter = tmp_path / "a"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4}))
    cases = {
        "not a Linear": {"base_model.model.model.norm.lora_A.weight": torch.zeros(2, 64),
                         "base_model.model.model.norm.lora_B.weight": torch.zeros(64, 2)},
        "do not fit": {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(2, 7),
                       "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(64, 2)},
        "lacks": {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(2, 64)},
        "not a LoRA": {"base_model.model.lm_head.weight": torch.zeros(4, 4)},
    }  # fmt: skip

    async def main():
        for match, tensors in cases.items():
            save_file(tensors, str(adapter / "adapter_model.safetensors"))
            with pytest.raises(InvalidRequest, match=match):
                await engine.load_lora_adapter("x", str(adapter))
        with pytest.raises(InvalidRequest, match="adapter_config"):
            await engine.load_lora_adapter("x", str(tmp_path / "missing"))
        (adapter / "adapter_config.json").write_text("[]")  # valid JSON, not a config
        with pytest.raises(InvalidRequest, match="must hold a JSON object"):
            await engine.load_lora_adapter("x", str(adapter))

    asyncio.run(main())
    assert engine.lora_names() == []


def test_an_adapter_in_use_is_not_unloaded_until_its_requests_are_done(tiny_model_dir, tmp_path):
    """/unload_lora_adapter while a request of the adapter streams: 409 naming it; once it is done: unloaded."""
    from safetensors.torch import save_file

    engine = make_engine(tiny_model_dir)
    adapter = tmp_path / "a"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4}))
    key = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file({f"{key}.lora_A.weight": torch.zeros(2, 64), f"{key}.lora_B.weight": torch.zeros(64, 2)},
              str(adapter / "adapter_model.safetensors"))  # fmt: skip
    params = SamplingParams(max_tokens=64, min_tokens=64, ignore_eos=True)

    async def main():
        await engine.start()
        try:
            await engine.load_lora_adapter("x", str(adapter))
            stream = engine.generate([1, 2, 3], params, lora_name="x")
            first = await stream.__anext__()  # streaming: the request is in the batch now
            with pytest.raises(InvalidRequest, match=r"'x' serves 1 request\(s\) now") as refused:
                await engine.unload_lora_adapter("x")
            assert refused.value.status == 409 and engine.lora_names() == ["x"]
            rest = [d async for d in stream]
            assert len(first.token_ids) + sum(len(d.token_ids) for d in rest) == 64
            await engine.unload_lora_adapter("x")
            assert engine.lora_names() == []
            with pytest.raises(InvalidRequest, match="unknown LoRA adapter 'x'"):
                engine.generate([1], SamplingParams(max_tokens=2), lora_name="x")
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_a_rows_copy_out_is_its_own_and_counts_its_bytes():
    """copy_out: row r's first n positions of every layer, copied (the buffers may change after), layers of one
    shape in one stack and of mixed shapes one by one; bytes_per_position counts keys and values of all layers."""
    cache = SlotKVCache(3, torch.float32, torch.device("cpu"))
    cache.keys = [torch.randn(4, 2, 8, 3) for _ in range(3)]
    cache.values = [torch.randn(4, 2, 8, 3) for _ in range(3)]
    for mixed in (False, True):
        if mixed:
            cache.keys[1], cache.values[1] = torch.randn(4, 1, 8, 5), torch.randn(4, 1, 8, 5)
        want = [b[2, :, :6].clone() for b in (*cache.keys, *cache.values)]
        keys, values = cache.copy_out(2, 6)
        for buf in (*cache.keys, *cache.values):
            buf.zero_()
        assert len(keys) == len(values) == 3
        assert all(torch.equal(got, w) for got, w in zip([*keys, *values], want))
    assert cache.bytes_per_position() == 4 * 2 * (2 * 3 * 2 + 1 * 5)


def test_kv_cache_growth_keeps_contents():
    cache = SlotKVCache(1, torch.float32, torch.device("cpu"))
    cache.ensure(2, 10)
    keys = torch.randn(1, 2, 3, 4)  # one prompt of 3 tokens, no padding, into slot 1
    cache.set_prefill(torch.tensor([1]), torch.tensor([0]), 3)
    cache.update(keys, keys + 1, 0)
    cache.ensure(5, 200)
    assert (cache.slots, cache.capacity) == (5, 256)
    assert torch.equal(cache.keys[0][1, :, :3], keys[0])
    cache.copy_row(1, 4, 3)
    assert torch.equal(cache.values[0][4, :, :3], keys[0] + 1)


def test_left_padded_prefill_writes_real_tokens_only():
    cache = SlotKVCache(1, torch.float32, torch.device("cpu"))
    cache.ensure(4, 8)
    keys = torch.arange(2 * 1 * 3 * 2, dtype=torch.float32).reshape(2, 1, 3, 2)  # b=2, H=1, P=3, D=2
    cache.set_prefill(torch.tensor([3, 0]), torch.tensor([1, 0]), 3)  # row 0 has one pad column
    cache.update(keys, keys, 0)
    assert torch.equal(cache.keys[0][3, 0, :2], keys[0, 0, 1:])
    assert torch.equal(cache.keys[0][0, 0, :3], keys[1, 0])
    assert cache.keys[0][3, 0, 2:].abs().sum() == 0


def test_masks():
    class Cfg:
        layer_types = ["full_attention", "sliding_attention"]
        sliding_window = 2
        _attn_implementation = "sdpa"

    masks = MaskBuilder(Cfg(), torch.float32)
    dec = masks.decode(torch.tensor([0, 3]), 4)
    assert dec["full_attention"][:, 0, 0].tolist() == [[True, False, False, False], [True, True, True, True]]
    assert dec["sliding_attention"][1, 0, 0].tolist() == [False, False, True, True]
    pre = masks.prefill(torch.tensor([1, 0]), 3)["full_attention"][:, 0]
    assert pre[0].tolist() == [[True, False, False], [False, True, False], [False, True, True]]
    assert pre[1].tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    ext = masks.extend(2, 2, torch.device("cpu"))["full_attention"][0, 0]
    assert ext.tolist() == [[True, True, True, False], [True, True, True, True]]

    class Hybrid(Cfg):
        layer_types = ["full_attention", "linear_attention"]

    with pytest.raises(ValueError, match="vllm"):
        MaskBuilder(Hybrid(), torch.float32)


def test_non_streaming_requests_get_one_delta_per_sequence(tiny_model_dir):
    """stream=False: each sequence arrives whole, at its finish, equal to the streamed deltas joined (same seed)."""
    engine = make_engine(tiny_model_dir)
    params = SamplingParams(max_tokens=7, n=2, seed=3, logprobs=2, ignore_eos=True)

    async def deltas(stream: bool):
        return [d async for d in engine.generate([65, 66, 67], params, stream=stream)]

    async def main():
        await engine.start()
        try:
            return await deltas(True), await deltas(False)
        finally:
            await engine.shutdown()

    streamed, whole = asyncio.run(main())
    assert len(streamed) == 2 * 7 and len(whole) == 2
    for d in whole:
        parts = [s for s in streamed if s.index == d.index]
        assert d.finish_reason == "length" and d.token_ids == [t for s in parts for t in s.token_ids]
        assert d.logprobs == [x for s in parts for x in s.logprobs] and d.text == "".join(s.text for s in parts)
        assert d.top_logprobs == [x for s in parts for x in s.top_logprobs]


def _cache_with_rows(rows: int, length: int) -> SlotKVCache:
    cache = SlotKVCache(2, torch.float32, torch.device("cpu"))
    cache.ensure(rows, length)
    cache.keys = [torch.randn(cache.slots, 1, cache.capacity, 2) for _ in range(2)]
    cache.values = [torch.randn(cache.slots, 1, cache.capacity, 2) for _ in range(2)]
    return cache


def test_prefix_cache_index_finds_the_longest_prefix():
    from asyncrl.inference.engine.prefix_cache import PrefixCache

    cache, prefix = _cache_with_rows(3, 100), PrefixCache(2**20)
    system = list(range(40))
    a, b = system + [1] * 30, system + [2] * 50
    prefix.store(None, a, cache, 0)
    prefix.store(None, b, cache, 1)
    prefix.store(None, a[:50], cache, 2)  # held inside `a`: not stored again
    assert len(prefix) == 2
    entry, n = prefix.lookup(None, a + [9])
    assert n == len(a) and torch.equal(entry.keys[1], cache.keys[1][0, :, : len(a)])
    assert prefix.lookup(None, b[:45] + [7] * 20)[1] == 45  # shares a full block, then 13 more tokens
    assert prefix.lookup(None, system + [3] * 20)[1] == 40  # the shared system prompt of either entry
    assert prefix.lookup("adapter", a + [9]) is None
    assert prefix.lookup(None, a[:31] + [5] * 20) is None  # under min_tokens
    assert (prefix.hits, prefix.reused_tokens) == (3, 70 + 45 + 40)


def test_prefix_cache_evicts_least_recently_used():
    from asyncrl.inference.engine.prefix_cache import PrefixCache

    cache = _cache_with_rows(3, 64)
    one = 2 * 2 * 1 * 64 * 2 * 4  # layers x (k, v) x heads x tokens x dim x bytes
    prefix = PrefixCache(2 * one)
    seqs = [[i] * 64 for i in range(3)]
    prefix.store(None, seqs[0], cache, 0)
    prefix.store(None, seqs[1], cache, 1)
    assert prefix.lookup(None, seqs[0] + [1]) is not None  # seqs[0] is now the most recently used
    prefix.store(None, seqs[2], cache, 2)  # evicts seqs[1]
    assert prefix.nbytes == 2 * one and len(prefix) == 2
    assert prefix.lookup(None, seqs[1] + [1]) is None and prefix.lookup(None, seqs[2] + [1]) is not None
    prefix.clear()
    assert prefix.nbytes == 0 and prefix.lookup(None, seqs[0] + [1]) is None


def test_prompts_with_cached_prefixes_prefill_in_one_batch(tiny_model_dir, hf_model):
    """Prompts reusing different cached prefix lengths, and one with none, prefill together in one
    forward (each row over its own cached prefix) and still match HF exactly."""
    engine = make_engine(tiny_model_dir)
    system = list(range(40, 100))
    params = SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True)
    batches = []
    original = engine._prefill_batch

    def counting(reqs, rows, batch, *rest):
        batches.append(sorted(start for _, start in batch))
        return original(reqs, rows, batch, *rest)

    engine._prefill_batch = counting

    async def drain(stream):
        return [d async for d in stream]

    async def run(prompts):
        streams = [engine.generate(p, params) for p in prompts]  # queued first, so they are admitted together
        await engine.start()
        try:
            return [[{"ids": [t for d in ds for t in d.token_ids], "lps": [x for d in ds for x in d.logprobs]}]
                    for ds in await asyncio.gather(*[drain(s) for s in streams])]  # fmt: skip
        finally:
            await engine.shutdown()

    [[first]] = asyncio.run(run([system + [5, 6, 7]]))
    prompts = [system + [11, 12], system[:40] + [1] * 10, [90, 91, 92], system + [5, 6, 7] + first["ids"] + [8]]
    results = asyncio.run(run(prompts))
    assert batches[1:] == [[0, 40, 60, 68]]  # one forward; the turn reuses all but its first turn's last token
    for prompt, [c] in zip(prompts, results):
        assert torch.allclose(torch.tensor(c["lps"]), hf_logprobs(hf_model, prompt, c["ids"], 1.0), atol=1e-5)


def hf_prompt_scores(model, prompt: list[int], k: int) -> tuple[torch.Tensor, list[int], list[list[int]]]:
    """(logprobs of prompt[1:] at T=1, their vLLM ranks, top-k ids per position) under a plain HF forward."""
    with torch.no_grad():
        lp = model(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)
    chosen = lp.gather(1, torch.tensor(prompt[1:])[:, None])
    ranks = (lp >= chosen).sum(-1).tolist()
    return chosen[:, 0], ranks, lp.topk(k, -1).indices.tolist() if k else []


def test_prompt_logprobs_batched_equal_each_alone_and_hf(tiny_model_dir, hf_model):
    """Concurrent scoring requests of different lengths (batched, padded, one chunked) beside generation:
    each one's prompt logprobs equal the same request alone and a HF forward at T=1 (whatever its
    temperature), with vLLM's ranks and top k; scoring forwards batch several prompts; generation stays exact."""
    engine = make_engine(tiny_model_dir, max_prefill_tokens=48)
    prompts = [list(range(60, 60 + n)) for n in (3, 17, 40, 9, 70, 1)] + [list(range(60, 69))]  # 70: chunked
    ks = [0, 2, 5, 0, 1, 3, 4]  # the last: the 9-token prompt again, with another k
    batches = []
    original = engine._prefill_batch

    def counting(reqs, rows, batch, *rest):
        batches.append((reqs[batch[0][0]].scoring, len(batch)))
        return original(reqs, rows, batch, *rest)

    engine._prefill_batch = counting

    async def score(prompt, k):
        params = SamplingParams(max_tokens=2, temperature=0.3, prompt_logprobs=k, logit_bias={5: 50.0})
        return [d.prompt_logprobs async for d in engine.generate(prompt, params) if d.prompt_logprobs]

    async def run(jobs, generate=False):
        gen = [collect(engine, list(range(30, 50)), SamplingParams(max_tokens=6, ignore_eos=True))] if generate else []
        await engine.start()
        try:
            return await asyncio.gather(*jobs, *gen)
        finally:
            await engine.shutdown()

    together = asyncio.run(run([score(p, k) for p, k in zip(prompts, ks)], generate=True))
    [gen] = together[-1]
    assert torch.allclose(torch.tensor(gen["lps"]), hf_logprobs(hf_model, list(range(30, 50)), gen["ids"], 1.0))
    assert any(scoring and n > 1 for scoring, n in batches)
    for prompt, k, [scores] in zip(prompts, ks, together):
        [[alone]] = asyncio.run(run([score(prompt, k)]))
        assert alone.ranks == scores.ranks and alone.top == scores.top and (scores.top is None) == (k == 0)
        assert torch.allclose(torch.tensor(scores.logprobs), torch.tensor(alone.logprobs), atol=1e-5)
        ref, ranks, top = hf_prompt_scores(hf_model, prompt, k)
        assert len(scores.logprobs) == len(prompt) - 1 and scores.ranks == ranks
        assert torch.allclose(torch.tensor(scores.logprobs), ref, atol=1e-5)
        assert [[t for t, _ in row] for row in scores.top or []] == top
    assert len(engine.prefix) == 0  # scoring rows leave no prefix entry (their prompts' logits need a forward)


def test_gpu_memory_utilization_caps_the_embedded_engine_on_a_gpu():
    from asyncrl.inference.engine.engine import kv_budget_on_gpu

    gib = 2**30
    assert kv_budget_on_gpu(free=60 * gib, total=80 * gib, utilization=None) == 30 * gib  # half the free memory
    # PRIME-RL's single-GPU mode: 0.5 of 80 GiB in all, 20 GiB already used (weights) -> 20 GiB of KV
    assert kv_budget_on_gpu(free=60 * gib, total=80 * gib, utilization=0.5) == 20 * gib
    with pytest.raises(UserError, match=r"gpu_memory_utilization 0.2 leaves no room .* 20.0 of 80.0 GiB are in use"):
        kv_budget_on_gpu(free=60 * gib, total=80 * gib, utilization=0.2)


def test_cuda_engine_takes_cudnn_out_of_attention(monkeypatch):
    """cuDNN's SDPA builds a plan per new shape, and every decode step is one (the H100 acceptance run: 400 vs
    6,089 tokens/s); the engine turns it off on CUDA and leaves the CPU's backends alone."""
    import torch

    from asyncrl.inference.engine.engine import no_cudnn_attention

    calls = []
    monkeypatch.setattr(torch.backends.cuda, "enable_cudnn_sdp", calls.append)
    assert not no_cudnn_attention(torch.device("cpu")) and calls == []
    assert no_cudnn_attention(torch.device("cuda", 0)) and calls == [False]
