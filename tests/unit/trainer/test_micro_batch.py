"""Several packed rows per forward (`data.micro_batch_size`) change nothing but speed.

Stacked rows (padded to the longest) and concatenated rows must give every token the logprob it
gets in its own row, and the loop's forward/backward over micro-batches of 1, 2 or 4 rows must give
the same loss, metrics and gradients as one row at a time, for every built-in loss. `check_packing`
tells the loop whether the attention backend isolates samples of stacked rows.
"""

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from asyncrl.config.trainer import TrainerConfig
from asyncrl.trainer.loss import token_logprobs
from asyncrl.trainer.model import check_packing
from asyncrl.trainer.rl.data import (
    PackedRow,
    concatenated_sizes,
    micro_batches,
    plan_forwards,
    prepare,
    split_to,
    stack_rows,
)
from asyncrl.trainer.rl.loop import RLLoop
from asyncrl.transport.row import Row

CPU = torch.device("cpu")
LAYOUT = [[9, 7, 12], [10, 6], [15], [5, 4]]  # samples per row: rows of 28, 16, 15 and 9 tokens


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa")


def logprobs_of(model, ids: torch.Tensor, pos: torch.Tensor, temps: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    return token_logprobs(logits, ids, temps)


@torch.no_grad()
def make_row(model, lengths: list[int], g: torch.Generator) -> PackedRow:
    """A packed row like the orchestrator's: 3 prompt tokens per sample, μ near this model's logprobs."""
    n = sum(lengths)
    ids = torch.randint(0, 256, (n,), generator=g)
    pos = torch.cat([torch.arange(k) for k in lengths])
    temps = torch.cat([torch.full((k,), 0.7 + 0.3 * i) for i, k in enumerate(lengths)])
    mask = pos >= 3
    mu = logprobs_of(model, ids[None], pos[None], temps[None])[0] + 0.3 * torch.randn(n, generator=g)
    mu[4] += 3.0  # one ratio far off: masks and clips take part
    adv = torch.cat([torch.full((k,), float(torch.randn(1, generator=g))) for k in lengths])
    return prepare(Row(ids, pos, mask, adv, mu * mask, temps), CPU)


@pytest.fixture(scope="module")
def rows(model) -> list[PackedRow]:
    g = torch.Generator().manual_seed(0)
    real = [make_row(model, lengths, g) for lengths in LAYOUT]
    dummy = make_row(model, LAYOUT[-1], g)  # the orchestrator's padding row: nothing to learn
    dummy.loss_mask = torch.zeros_like(dummy.loss_mask)
    return real + [dummy]


@pytest.mark.parametrize("stack", [True, False], ids=["stacked", "concatenated"])
def test_rows_of_a_batch_keep_their_own_logprobs(model, rows, stack):
    mb = stack_rows(rows, stack)
    assert mb.input_ids.shape == ((5, 28) if stack else (1, 28 + 16 + 15 + 9 + 9))
    assert mb.sample_ids.flatten().unique().numel() == mb.num_samples  # padding is a sample of its own
    assert int(mb.loss_mask.sum()) == sum(int(r.loss_mask.sum()) for r in rows)
    with torch.no_grad():
        batched = logprobs_of(model, mb.input_ids, mb.position_ids, mb.temperatures)
        at = 0
        for b, r in enumerate(rows):
            n = r.input_ids.numel()
            got = batched[b, :n] if stack else batched[0, at : at + n]
            alone = logprobs_of(model, r.input_ids[None], r.position_ids[None], r.temperatures[None])[0]
            targets = r.position_ids != 0  # a sample's first token has no prefix: never a loss token
            torch.testing.assert_close(got[targets], alone[targets], atol=1e-5, rtol=1e-5)
            at += n


def loss_config(loss: str) -> dict:
    """dppo with a trust region narrow enough to engage on these rows (and its kl_tau term on)."""
    return {"type": loss} | ({"dppo_mask_low": 0.01, "dppo_mask_high": 0.01, "kl_tau": 1e-3} if loss == "dppo" else {})


def run_step(
    model, rows: list[PackedRow], loss: str, size: int, stack: bool, sizes: list[int] | None = None
) -> tuple[dict, list[torch.Tensor]]:
    """The loop's forward/backward over every micro-batch: summed metrics and the accumulated gradients."""
    model.zero_grad(set_to_none=True)
    loop = RLLoop(SimpleNamespace(config=TrainerConfig(loss=loss_config(loss)), model=model))
    scale = 1.0 / sum(int(r.loss_mask.sum()) for r in rows)
    sums: dict = defaultdict(float)
    for mb in micro_batches(rows, size, stack, sizes):
        for key, value in loop.forward_backward_step(mb, scale).items():
            sums[key] += float(value)
    return dict(sums), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("loss", ["aipo", "dppo", "grpo", "gspo", "cispo", "m2po"])
def test_micro_batch_size_keeps_loss_metrics_and_gradients(model, rows, loss):
    model.train()
    one_sums, one_grads = run_step(model, rows, loss, 1, True)
    assert one_sums["loss"] != 0 and one_sums.get("clipped_frac", one_sums["masked_frac"]) > 0  # not trivial
    for size, stack, sizes in [
        (2, True, None),
        (4, True, None),
        (8, True, None),
        (4, False, None),
        (4, True, [1, 3, 1]),
    ]:
        sums, grads = run_step(model, rows, loss, size, stack, sizes)
        assert sums.keys() == one_sums.keys()
        for key in sums:
            assert sums[key] == pytest.approx(one_sums[key], rel=1e-5, abs=1e-6), (key, size, stack)
        for got, want in zip(grads, one_grads):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-4)


def cost(length: int) -> float:
    return length * (1 + length / 512)  # per row: linear layers plus attention over the padded length


def test_plan_forwards_keeps_short_rows_apart_from_long_ones():
    # two groups per 256-token row for some rows, one for the rest: one stacked forward pads 8 rows by ~105
    assert plan_forwards([256] * 4 + [151] * 8, 16, cost, cost(64)) == [4, 8]
    assert plan_forwards([256] * 12, 16, cost, cost(64)) == [12]  # equal rows: one pass, nothing to save
    assert plan_forwards([200, 190, 180, 30], 16, cost, cost(64)) == [3, 1]
    # never more than micro_batch_size rows in one pass (memory), as few passes as that allows
    sizes = plan_forwards([100] * 10, 4, cost, cost(64))
    assert sum(sizes) == 10 and max(sizes) <= 4 and len(sizes) == 3
    assert plan_forwards([], 4, cost, cost(64)) == []


def test_a_token_budget_caps_each_forward_and_a_longer_row_runs_alone():
    # 16k-token rows: one per forward at the default 16,384 tokens, whatever micro_batch_size allows
    assert plan_forwards([16384] * 3, 16, cost, cost(64), 16384) == [1, 1, 1]
    assert plan_forwards([20000, 100, 100], 16, cost, cost(64), 16384) == [1, 2]  # over the budget: alone
    sizes = plan_forwards([1000] * 40, 16, cost, cost(64), 8000)
    assert sum(sizes) == 40 and max(sizes) <= 8  # 8 x 1000 tokens per forward at most
    assert plan_forwards([256] * 12, 16, cost, cost(64), None) == [12]  # no budget: rows alone decide
    # concatenated rows (no padding): in order, within both limits
    assert concatenated_sizes([300, 200, 200, 100, 50], 16, 500) == [2, 3]
    assert concatenated_sizes([900, 10], 16, 500) == [1, 1]
    assert concatenated_sizes([10] * 5, 2, None) == [2, 2, 1]
    assert concatenated_sizes([], 2, 100) == []


def test_split_to_gives_every_rank_as_many_forwards():
    assert split_to([4, 8], 2) == [4, 8]
    assert split_to([12], 3) == [3, 3, 6]
    assert split_to([1, 1, 2], 4) == [1, 1, 1, 1]
    with pytest.raises(ValueError, match="cannot split 2 rows into 3"):
        split_to([1, 1], 3)


class RowwiseOnly(torch.nn.Module):
    """Like flash attention: reads sample boundaries from position_ids of a single row only."""

    def __init__(self, inner) -> None:
        super().__init__()
        self.inner, self.config = inner, inner.config

    def get_input_embeddings(self):
        return self.inner.get_input_embeddings()

    def forward(self, input_ids, position_ids=None, **kwargs):
        return self.inner(input_ids=input_ids, position_ids=position_ids if len(input_ids) == 1 else None, **kwargs)


def test_check_packing_tells_whether_rows_can_be_stacked(model):
    assert check_packing(model) is True
    assert check_packing(RowwiseOnly(model)) is False  # the loop then concatenates rows


def test_distributions_for_wandb_hold_every_loss_token(model, rows):
    """`--trainer.wandb.log-extras.distributions`: per-token ratio, advantage and entropy of the step."""
    loop = RLLoop(SimpleNamespace(config=TrainerConfig(), model=model))
    loop._dists = defaultdict(list)  # what next_batch sets when the sink says they are due
    for mb in micro_batches(rows, 2, True):
        loop.forward_backward_step(mb, 1.0)
    dists = {k: torch.cat(v) for k, v in loop.take_distributions().items()}
    tokens = sum(int(r.loss_mask.sum()) for r in rows)
    assert sorted(dists) == ["dist/advantage", "dist/entropy", "dist/importance_ratio"]
    assert all(v.numel() == tokens for v in dists.values())
    assert dists["dist/importance_ratio"].min() < 0.1  # the far-off token of make_row (mu + 3) is in there
    assert sorted(dists["dist/advantage"].unique().tolist()) == sorted(
        {float(a) for r in rows for a in r.advantages[r.loss_mask].unique()}
    )
    assert loop.take_distributions() == {}  # taken once; none collected until they are due again
