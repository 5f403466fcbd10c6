"""The chunked head's statistics and gradients against autograd through full logits (`trainer.loss`)."""

import pytest
import torch
from torch import nn

from asyncrl.trainer import head as head_mod
from asyncrl.trainer.head import (
    ENTROPY,
    LOGPROB,
    TEACHER_CE,
    TEACHER_KL,
    HeadRequest,
    head_setting,
    head_stats,
    model_stats,
    stats_from_rows,
)
from asyncrl.trainer.loss import entropy_with_grad, teacher_cross_entropy, token_logprobs

ROWS, LENGTH, HIDDEN, VOCAB, K = 3, 7, 8, 11, 3


def batch(shared: bool, teacher: bool, seed: int = 0) -> HeadRequest:
    """Stacked rows; `shared`: parents as shared-prefix rows have them (row 1's tokens 3.. fork off position 1)."""
    g = torch.Generator().manual_seed(seed)
    parents = None
    if shared:
        parents = torch.arange(-1, LENGTH - 1).repeat(ROWS, 1)
        parents[1, 3:] = torch.tensor([1, 3, 4, 5])
        parents[2, 4] = -1  # a new sample starts: predicted by nothing
    t_ids = t_w = None
    if teacher:
        t_ids = torch.randint(0, VOCAB, (ROWS, LENGTH, K), generator=g)
        t_w = torch.rand(ROWS, LENGTH, K, generator=g) * (torch.rand(ROWS, LENGTH, 1, generator=g) > 0.3)
        t_w[:, 0] = 0  # a token without a predictor (a row's first, parent -1) has no targets
        if parents is not None:
            t_w[parents < 0] = 0
    return HeadRequest(
        input_ids=torch.randint(0, VOCAB, (ROWS, LENGTH), generator=g),
        temperatures=0.5 + torch.rand(ROWS, LENGTH, generator=g),
        parents=parents,
        teacher_ids=t_ids,
        teacher_targets=t_w,
    )


def reference(logits: torch.Tensor, req: HeadRequest) -> dict[str, torch.Tensor]:
    """Summed statistics through full logits, as the trainer computed them before the chunked head."""
    out = {"logprob": token_logprobs(logits, req.input_ids, req.temperatures, req.parents)}
    parents = req.parents if req.parents is not None else [None] * ROWS
    rows = zip(logits, req.temperatures, parents)
    out["entropy"] = torch.stack([entropy_with_grad(lg, t, 4, p) for lg, t, p in rows])
    if req.teacher_ids is not None:
        out["ce"], out["kl"] = teacher_cross_entropy(
            logits, req.temperatures, req.teacher_ids, req.teacher_targets, req.parents
        )
    return out


def loss_of(values: dict[str, torch.Tensor], weights: torch.Tensor) -> torch.Tensor:
    """A loss that reaches every statistic with a different weight per token."""
    loss = (values["logprob"] * weights).sum() - 0.3 * (values["entropy"] * weights.flip(-1)).sum()
    return loss + 0.7 * values["ce"] if "ce" in values else loss


def as_values(stats: torch.Tensor, teacher: bool) -> dict[str, torch.Tensor]:
    out = {"logprob": stats[..., LOGPROB], "entropy": stats[..., ENTROPY]}
    if teacher:
        out["ce"], out["kl"] = stats[..., TEACHER_CE].sum(), stats[..., TEACHER_KL].sum()
    return out


@pytest.mark.parametrize("chunk_bytes", [4 * VOCAB * 2, 2**20], ids=["chunks-of-2", "one-chunk"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shared,teacher", [(False, False), (True, False), (False, True), (True, True)])
def test_chunked_head_equals_full_logits(monkeypatch, chunk_bytes, bias, shared, teacher):
    monkeypatch.setattr(head_mod, "CHUNK_BYTES", chunk_bytes)
    torch.manual_seed(0)
    lin = nn.Linear(HIDDEN, VOCAB, bias=bias).double()
    hidden = torch.randn(ROWS, LENGTH, HIDDEN, dtype=torch.float64, requires_grad=True)
    req = batch(shared, teacher)
    req.temperatures = req.temperatures.double()
    weights = torch.randn(ROWS, LENGTH, dtype=torch.float64)

    want = reference(lin(hidden), req)
    loss_of(want, weights).backward()
    want_grads = [t.grad.clone() for t in (hidden, *lin.parameters())]
    for t in (hidden, *lin.parameters()):
        t.grad = None

    stats = stats_from_rows(hidden, req, lin.weight, lin.bias)
    got = as_values(stats, teacher)
    for key, value in want.items():
        torch.testing.assert_close(got[key].to(value.dtype), value, rtol=1e-5, atol=1e-6, msg=key)
    loss_of(got, weights).backward()
    for w, t in zip(want_grads, (hidden, *lin.parameters())):
        torch.testing.assert_close(t.grad, w, rtol=1e-5, atol=1e-6)


def test_from_logits_rows_the_same_statistics_and_gradient():
    """No head (weight None): the rows are logits; the fallback for models whose logits are not the head's."""
    torch.manual_seed(1)
    logits = torch.randn(ROWS, LENGTH, VOCAB, dtype=torch.float64, requires_grad=True)
    req = batch(True, True, seed=3)
    weights = torch.randn(ROWS, LENGTH, dtype=torch.float64)
    loss_of(reference(logits, req), weights).backward()
    want = logits.grad.clone()
    logits.grad = None
    loss_of(as_values(stats_from_rows(logits, req), True), weights).backward()
    torch.testing.assert_close(logits.grad, want, rtol=1e-5, atol=1e-6)


def test_head_stats_replaces_the_logits_of_a_model_and_restores_it(tiny_model):
    ids = torch.randint(0, 200, (2, 9))
    plain = tiny_model(input_ids=ids, use_cache=False).logits
    req = HeadRequest(input_ids=ids, temperatures=torch.ones(2, 9))
    with head_stats(tiny_model, req):
        stats = tiny_model(input_ids=ids, use_cache=False).logits
    assert stats.shape == (2, 9, 4) and req.consumed
    torch.testing.assert_close(stats[..., LOGPROB], token_logprobs(plain, ids, req.temperatures))
    assert torch.equal(tiny_model(input_ids=ids, use_cache=False).logits, plain)  # the head is itself again


def test_a_model_that_skips_its_head_is_an_error(tiny_model):
    req = HeadRequest(input_ids=torch.zeros(1, 3, dtype=torch.long), temperatures=torch.ones(1, 3))
    with pytest.raises(RuntimeError, match="without calling its lm_head"), head_stats(tiny_model, req):
        pass


@pytest.mark.parametrize("setting", ["disabled", 3])
def test_a_model_through_full_logits_or_small_chunks_trains_alike(tiny_model, setting):
    """`model.fused_lm_head_chunk_size`: 'disabled' (full logits) and 3 positions per chunk give the default's
    statistics and parameter gradients."""
    ids = torch.randint(0, 200, (2, 9), generator=torch.Generator().manual_seed(4))
    temps = torch.full((2, 9), 0.8)

    def grads(value) -> tuple[torch.Tensor, list[torch.Tensor]]:
        tiny_model.zero_grad()
        stats = model_stats(tiny_model, HeadRequest(ids, temps, **head_setting(value)), input_ids=ids, use_cache=False)
        (stats[..., LOGPROB].sum() - stats[..., ENTROPY].sum()).backward()
        return stats.detach(), [p.grad.clone() for p in tiny_model.parameters()]

    (want, want_grads), (got, got_grads) = grads(None), grads(setting)
    torch.testing.assert_close(got, want)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
