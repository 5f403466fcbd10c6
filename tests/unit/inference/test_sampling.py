"""The embedded engine's batched sampler: filters, seeds, and exact logprobs of the sampled distribution."""

import math

import pytest
import torch

from asyncrl.inference.api.backend import SamplingParams
from asyncrl.inference.engine.sampling import RowSampler, sample

CPU = torch.device("cpu")


def rows(n: int, seed: int | None = None, **kw) -> list[RowSampler]:
    params = SamplingParams(max_tokens=1, **kw)
    return [RowSampler(params, None if seed is None else seed + i, CPU) for i in range(n)]


def test_unfiltered_logprob_is_log_softmax_of_scaled_logits():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    out = sample(logits, rows(6, temperature=0.7))
    ref = (logits / 0.7).log_softmax(-1)
    for i, (t, lp) in enumerate(zip(out.tokens, out.logprobs)):
        assert lp == pytest.approx(ref[i, t].item(), abs=1e-6)


def test_greedy_rows_take_argmax_with_unscaled_logprob():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 0.0]])
    out = sample(logits, rows(2, temperature=0.0))
    assert out.tokens == [1, 0]
    ref = logits.log_softmax(-1)
    assert out.logprobs == pytest.approx([ref[0, 1].item(), ref[1, 0].item()], abs=1e-6)


def test_mixed_batch_each_row_its_own_params():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]] * 3)
    samplers = [
        RowSampler(SamplingParams(max_tokens=1, temperature=0.0), None, CPU),
        RowSampler(SamplingParams(max_tokens=1, top_k=1), None, CPU),
        RowSampler(SamplingParams(max_tokens=1, temperature=2.0), 1, CPU),
    ]
    out = sample(logits, samplers)
    assert out.tokens[:2] == [3, 3]
    assert out.logprobs[1] == 0.0  # top_k=1 leaves one token with probability 1
    assert out.logprobs[2] == pytest.approx((logits[2] / 2.0).log_softmax(-1)[out.tokens[2]].item(), abs=1e-6)


def test_top_p_keeps_the_smallest_nucleus_and_renormalizes():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()[None].repeat(400, 1)
    out = sample(logits, rows(400, seed=0, top_p=0.75))
    assert set(out.tokens) == {0, 1}  # 0.5 < 0.75 needs the second; 0.8 >= 0.75 stops there
    for t, lp in zip(out.tokens, out.logprobs):
        assert lp == pytest.approx(math.log(probs[t] / 0.8), abs=1e-5)


def test_min_p_and_top_k():
    probs = torch.tensor([0.6, 0.3, 0.08, 0.02])
    logits = probs.log()[None].repeat(400, 1)
    out = sample(logits, rows(400, seed=0, min_p=0.2))  # keeps p >= 0.12
    assert set(out.tokens) == {0, 1}
    out = sample(logits, rows(400, seed=0, top_k=3))
    assert set(out.tokens) == {0, 1, 2}
    for t, lp in zip(out.tokens, out.logprobs):
        assert lp == pytest.approx(math.log(probs[t] / 0.98), abs=1e-5)


def test_empirical_distribution_matches():
    torch.manual_seed(1)
    logits = torch.randn(1, 8).repeat(20000, 1)
    out = sample(logits, rows(20000, temperature=0.8))
    freq = torch.bincount(torch.tensor(out.tokens), minlength=8).float() / 20000
    expected = (logits[0] / 0.8).softmax(-1)
    assert torch.allclose(freq, expected, atol=0.015)


def test_seeds_reproduce_and_differ():
    logits = torch.randn(4, 300)
    a = sample(logits, rows(4, seed=10)).tokens
    b = sample(logits, rows(4, seed=10)).tokens
    c = [sample(logits, rows(4, seed=11)).tokens for _ in range(3)]
    assert a == b and any(x != a for x in c)


def test_banned_ids_and_logit_bias_and_top_logprobs():
    logits = torch.zeros(2, 5)
    samplers = rows(2, seed=0, temperature=1.0, logprobs=2)
    samplers[1].params = SamplingParams(max_tokens=1, logit_bias={4: 50.0}, logprobs=2)
    out = sample(logits, samplers, banned=[[0, 1, 2, 3], []])
    assert out.tokens == [4, 4]
    assert out.logprobs[0] == 0.0 and out.logprobs[1] == pytest.approx(0.0, abs=1e-6)
    assert [t for t, _ in out.top[0]][0] == 4 and len(out.top[0]) == 2
    assert out.top[0][1][1] == float("-inf")  # banned tokens have no mass
