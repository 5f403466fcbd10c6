"""Shared-prefix rows train exactly like their expanded (unshared) form, only with fewer tokens computed.

Rows hold groups (a prompt computed once, continuations forking at different positions) next to plain
samples. With sdpa and eager attention, the shared rows and their `Row.expanded` rows must
give the same logprobs on every loss token, the same loss and metrics, and the same gradients, one row
per forward, several stacked, or concatenated. Other attention gets the rows expanded, logged once.
ASYNCRL_TEST_DEVICE=cuda runs the same checks on a GPU's attention kernels (scripts/gpu_check.sh does).
"""

import os
from collections import defaultdict
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from asyncrl.config.trainer import TrainerConfig
from asyncrl.trainer.loss import token_logprobs
from asyncrl.trainer.perf import FlopModel
from asyncrl.trainer.rl.data import micro_batches, prepare, stack_rows
from asyncrl.trainer.rl.loop import RLLoop
from asyncrl.transport.prefix import segments
from asyncrl.transport.row import Row

DEVICE = torch.device(os.environ.get("ASYNCRL_TEST_DEVICE", "cpu"))
TOL = {"atol": 1e-5, "rtol": 1e-5} if DEVICE.type == "cpu" else {"atol": 1e-4, "rtol": 1e-4}  # other kernels
PROMPT = 3  # plain samples: loss from this position on

# one row per entry: ("group", first sample's prompt, its completion, [(fork, continuation length), ...])
# or ("plain", length); forks are at most the prompt, so shared tokens never carry loss
LAYOUT = [
    [("group", 6, 5, [(6, 4), (6, 7), (3, 5)]), ("plain", 8), ("group", 4, 3, [(4, 5)])],
    [("plain", 9), ("group", 5, 4, [(2, 6), (5, 3), (4, 4)])],
    [("plain", 7), ("plain", 5)],
]


def layout_row(layout, g: torch.Generator) -> dict:
    """position_ids, loss_mask, temperatures and advantages of one row (ids and μ filled in later)."""
    pos, loss, temps, adv = [], [], [], []

    def add(p: torch.Tensor, loss_from: int) -> None:
        pos.append(p)
        loss.append(p >= loss_from)
        temps.append(torch.full(p.shape, 0.7 + 0.6 * float(torch.rand(1, generator=g))))
        adv.append(torch.full(p.shape, float(torch.randn(1, generator=g))))

    for entry in layout:
        if entry[0] == "plain":
            add(torch.arange(entry[1]), PROMPT)
            continue
        _, prompt, completion, continuations = entry
        add(torch.arange(prompt + completion), prompt)
        for fork, n in continuations:
            add(torch.arange(fork, fork + n), prompt)  # a fork before the prompt's end re-writes some prompt
    out = {"position_ids": pos, "loss_mask": loss, "temperatures": temps, "advantages": adv}
    return {k: torch.cat(v) for k, v in out.items()}


def logprobs(model, row: Row) -> torch.Tensor:
    """The model's logprobs of a plain row."""
    ids, pos = row.input_ids[None].to(DEVICE), row.position_ids[None].to(DEVICE)
    logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
    return token_logprobs(logits, ids[0], row.temperatures.to(DEVICE)).cpu()


@torch.no_grad()
def shared_rows(model, noise: float, seed: int = 0) -> list[Row]:
    """Shared rows whose μ is the model's own logprob of the expanded row (+ noise), one ratio far off."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for layout in LAYOUT:
        parts = layout_row(layout, g)
        ids = torch.randint(0, 256, parts["position_ids"].shape, generator=g)
        row = Row(input_ids=ids, inference_logprobs=torch.zeros(ids.shape), **parts)
        index = replace(row, input_ids=torch.arange(ids.numel())).expanded().input_ids
        mu = torch.zeros(ids.shape)
        mu[index] = logprobs(model, row.expanded())  # the shared tokens are copies: written twice, same value
        mu += noise * torch.randn(mu.shape, generator=g)
        mu[-1] += 3.0 * (noise > 0)  # masks and clips take part
        rows.append(replace(row, advantages=row.advantages * row.loss_mask, inference_logprobs=mu * row.loss_mask))
    return rows


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def model(request, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation=request.param)
    return model.to(DEVICE)


def test_rows_are_shared_and_shorter(model):
    rows = shared_rows(model, 0.3)
    assert [segments(r.position_ids).shared for r in rows] == [True, True, False]
    expanded = [r.expanded() for r in rows]
    assert sum(r.input_ids.numel() for r in rows) < sum(r.input_ids.numel() for r in expanded)
    assert [int(r.loss_mask.sum()) for r in rows] == [int(r.loss_mask.sum()) for r in expanded]


def loss_config(loss: str) -> dict:
    """dppo with a trust region narrow enough to engage on these rows (and its kl_tau term on)."""
    return {"type": loss} | ({"dppo_mask_low": 0.01, "dppo_mask_high": 0.01, "kl_tau": 1e-3} if loss == "dppo" else {})


def run_step(model, rows: list[Row], loss: str, size: int, stack: bool) -> tuple[dict, list[torch.Tensor]]:
    """The loop's forward/backward over every micro-batch: summed metrics and the accumulated gradients."""
    model.zero_grad(set_to_none=True)
    loop = RLLoop(SimpleNamespace(config=TrainerConfig(loss=loss_config(loss)), model=model))
    packed = [prepare(r, DEVICE) for r in rows]
    scale = 1.0 / sum(int(r.loss_mask.sum()) for r in packed)
    sums: dict = defaultdict(float)
    for mb in micro_batches(packed, size, stack):
        for key, value in loop.forward_backward_step(mb, scale).items():
            sums[key] += float(value)
    return dict(sums), [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("stack", [True, False], ids=["stacked", "concatenated"])
@pytest.mark.parametrize("size", [1, 3])
@torch.no_grad()
def test_loss_token_logprobs_equal_the_expanded_rows(model, stack, size):
    rows = shared_rows(model, 0.3)[:size]
    mb = stack_rows([prepare(r, DEVICE) for r in rows], stack)
    kwargs = RLLoop(SimpleNamespace(config=TrainerConfig())).mask_kwargs(mb, model.config._attn_implementation)
    assert "attention_mask" in kwargs and mb.parents is not None
    logits = model(input_ids=mb.input_ids, position_ids=mb.position_ids, **kwargs).logits
    got = token_logprobs(logits, mb.input_ids, mb.temperatures, mb.parents)[mb.loss_mask]
    want = torch.cat([logprobs(model, p)[p.loss_mask] for p in (r.expanded() for r in rows)])
    torch.testing.assert_close(got.cpu(), want, **TOL)


@pytest.mark.parametrize("loss", ["aipo", "dppo", "grpo"])
def test_loss_metrics_and_gradients_equal_the_expanded_rows(model, loss):
    model.train()
    rows = shared_rows(model, 0.3)
    want_sums, want_grads = run_step(model, [r.expanded() for r in rows], loss, 1, True)
    assert want_sums["loss"] != 0 and want_sums.get("clipped_frac", want_sums["masked_frac"]) > 0  # not trivial
    for size, stack in [(1, True), (2, True), (3, True), (3, False)]:
        sums, grads = run_step(model, rows, loss, size, stack)
        assert sums.keys() == want_sums.keys()
        for key in sums:
            assert sums[key] == pytest.approx(want_sums[key], rel=TOL["rtol"], abs=TOL["atol"] / 10), (key, size, stack)
        for got, want in zip(grads, want_grads, strict=True):
            torch.testing.assert_close(got, want, **TOL)


def test_own_logprobs_give_zero_mismatch_kl(model):
    model.eval()
    rows = shared_rows(model, 0.0)
    sums, _ = run_step(model, rows, "aipo", 3, True)
    assert sums["mismatch_kl"] < 1e-6 and sums["masked_frac"] == 0


def test_plain_batches_take_the_plain_path(model):
    mb = stack_rows([prepare(r, DEVICE) for r in shared_rows(model, 0.3)[2:]])
    assert mb.parents is None and mb.attention_mask is None


def test_other_attention_gets_expanded_rows_logged_once(model, caplog_loguru):
    rows = shared_rows(model, 0.3)
    flash = SimpleNamespace(config=SimpleNamespace(_attn_implementation="flash_attention_2"))
    loop = RLLoop(SimpleNamespace(config=TrainerConfig(), model=flash, ctx=SimpleNamespace(is_main=True)))
    for _ in range(2):
        got = loop._shareable(rows)
        assert not any(segments(r.position_ids).shared for r in got)
        assert [r.input_ids.tolist() for r in got] == [r.expanded().input_ids.tolist() for r in rows]
    before, after = sum(r.input_ids.numel() for r in rows), sum(r.input_ids.numel() for r in got)
    told = [m for m in caplog_loguru if "cannot share prefixes" in m]
    assert told == [
        f"attention 'flash_attention_2' cannot share prefixes in one row; expanding shared prefixes "
        f"({before} → {after} tokens per step on this rank)"
    ]
    assert loop._shareable(rows[2:]) == rows[2:]  # plain rows pass as they are
    mb = stack_rows([prepare(r, DEVICE) for r in rows])
    with pytest.raises(ValueError, match="must be unshared"):
        loop.mask_kwargs(mb, "flash_attention_2")


def test_a_mask_over_budget_gets_expanded_rows_logged_once(model, caplog_loguru, monkeypatch):
    import asyncrl.trainer.rl.loop as rl_loop

    rows = shared_rows(model, 0.3)
    sdpa = SimpleNamespace(config=SimpleNamespace(_attn_implementation="sdpa"))
    loop = RLLoop(SimpleNamespace(config=TrainerConfig(), model=sdpa, ctx=SimpleNamespace(is_main=True)))
    assert loop._shareable(rows) is rows  # within budget: shared as they are
    longest = max(r.input_ids.numel() for r in rows)
    monkeypatch.setattr(rl_loop, "MASK_BUDGET_BYTES", longest**2 * len(rows) - 1)
    for _ in range(2):
        got = loop._shareable(rows)
        assert [r.input_ids.tolist() for r in got] == [r.expanded().input_ids.tolist() for r in rows]
    told = [m for m in caplog_loguru if "shared-prefix mask would take" in m]
    assert len(told) == 1 and "lower trainer.data.micro_batch_size or seq_len" in told[0]


def test_counts_are_the_tokens_computed(model):
    rows = shared_rows(model, 0.3)
    loop = RLLoop(SimpleNamespace(config=TrainerConfig(), flops=FlopModel(1000, 2, 4, 16)))
    expanded = [r.expanded() for r in rows]
    shared, plain = (loop._counts([prepare(r, DEVICE) for r in x]).tolist() for x in (rows, expanded))
    assert shared[0] == plain[0] and shared[2] == plain[2] == 14  # loss tokens; samples with a loss token
    assert shared[1] == sum(r.input_ids.numel() for r in rows) < plain[1]  # tokens: the prefix once
    assert shared[3] < plain[3]


def test_lora_gradients_equal_the_expanded_rows(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from asyncrl.trainer.lora import apply_lora

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa")
    apply_lora(model, rank=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj"])
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.05)  # B starts at 0: make every LoRA weight matter
    rows = shared_rows(model, 0.3)
    want_sums, want_grads = run_step(model, [r.expanded() for r in rows], "aipo", 1, True)
    sums, grads = run_step(model, rows, "aipo", 3, True)
    assert sums["loss"] == pytest.approx(want_sums["loss"], rel=1e-5) and len(grads) == len(want_grads) > 0
    for got, want in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
