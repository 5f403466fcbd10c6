"""A mixed-run step (`RLLoop.forward_backward_together`) gives every run what training it alone gives.

Three runs share one model with multi-slot adapters; their rows go through shared forward passes (stacked, of
several runs each, or concatenated, one run each), every row through its own run's adapter, each run's loss on its
own rows. For every built-in loss, each run's token sums and its slot's gradients must equal those of the run's
step trained alone (its own micro-batches, its slot active), runs of different losses, entropy bonus, reference KL
and forward-KL targets mixed together; a slot outside the round gets no gradient; a run whose loss is NaN leaves
the others' gradients as they were.
"""

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from asyncrl.config.trainer import TrainerConfig
from asyncrl.trainer.lora import apply_multi_lora
from asyncrl.trainer.rl.data import PackedRow, micro_batches, mixed_micro_batches
from asyncrl.trainer.rl.loop import RLLoop
from tests.unit.trainer.test_micro_batch import loss_config, make_row

CPU = torch.device("cpu")
SLOTS = 4
LAYOUTS = [[[9, 7, 12], [10, 6], [5, 4]], [[15], [8, 8, 4], [6]], [[11, 9], [7], [12, 3]]]  # per run: its rows


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa")
    sel, _ = apply_multi_lora(model, 4, 8.0, 0.0, ["q_proj", "v_proj", "down_proj"], SLOTS)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # trained-looking adapters: B nonzero, so every A gets a gradient too
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    model.selector = sel
    return model.train()


@pytest.fixture(scope="module")
def runs(model) -> list[list[PackedRow]]:
    g = torch.Generator().manual_seed(0)
    out = [[make_row(model, lengths, g) for lengths in layout] for layout in LAYOUTS]
    for row in out[2]:  # run 2 also distills: the teacher's top 3 at every loss token
        n = row.input_ids.numel()
        row.teacher_ids = torch.randint(0, 256, (n, 3), generator=g)
        row.teacher_targets = torch.rand(n, 3, generator=g) * row.loss_mask[:, None] * 0.5
    return out


def loops_for(model, losses: list[dict], size: int, stack: bool, head: int | str | None = None) -> list[RLLoop]:
    """One RL loop per run, each its own loss config and adapter slot (1, 3, 0: not in slot order); `head`: the
    runs' `model.fused_lm_head_chunk_size`."""
    ctx = SimpleNamespace(world_size=1, device=CPU, all_reduce_max=lambda n: n)
    lm = SimpleNamespace(stackable=stack, selector=model.selector)
    flops = SimpleNamespace(row_flops=lambda lengths: float(lengths.sum()))
    loops = []
    for slot, loss in zip((1, 3, 0), losses):
        config = TrainerConfig(loss=loss, data={"micro_batch_size": size}, model={"fused_lm_head_chunk_size": head})
        session = SimpleNamespace(
            config=config, model=model, ctx=ctx, lm=lm, flops=flops, slot=SimpleNamespace(index=slot)
        )
        session.loss_scale = lambda batch: 1.0 / max(batch.loss_tokens, 1)  # TrainSession's, one rank
        loop = RLLoop(session)
        loop.reference = model if loss.get("ref_kl") else None  # LoRA: the base, adapters off
        loops.append(loop)
    return loops


def slot_grads(model, slot: int) -> list[torch.Tensor | None]:
    return [p.grad for n, p in model.named_parameters() if n.endswith(f".{slot}")]


def floats(sums: dict) -> dict[str, float]:
    return {k: float(v) for k, v in sums.items()}


def alone(model, loop: RLLoop, rows: list[PackedRow]) -> tuple[dict, list]:
    """Run `loop`'s step by itself, one run's micro-batches with its slot active (the single-run path)."""
    model.zero_grad(set_to_none=True)
    scale = 1.0 / sum(int(r.loss_mask.sum()) for r in rows)
    sums: dict = defaultdict(float)
    with model.selector.mixed([loop.session.slot.index], None):
        for mb in micro_batches(rows, loop.config.data.micro_batch_size, loop.session.lm.stackable):
            for key, value in loop.forward_backward_step(mb, scale).items():
                sums[key] += float(value)
    return dict(sums), [g.clone() for g in slot_grads(model, loop.session.slot.index)]


def together(model, loops: list[RLLoop], runs: list[list[PackedRow]]) -> list[dict]:
    model.zero_grad(set_to_none=True)
    batches = [
        SimpleNamespace(micro_batches=rows, loss_tokens=sum(int(r.loss_mask.sum()) for r in rows)) for rows in runs
    ]
    return [floats(s) for s in RLLoop.forward_backward_together(loops, batches)]


@pytest.mark.parametrize("loss", ["aipo", "dppo", "grpo", "gspo", "cispo", "m2po"])
@pytest.mark.parametrize(("size", "stack"), [(4, True), (2, True), (9, True), (3, False)])
def test_a_mixed_step_is_each_run_trained_alone(model, runs, loss, size, stack):
    losses = [loss_config(loss), loss_config(loss) | {"entropy_coef": 0.01}, {"type": "cispo", "ref_kl": 0.1}]
    loops = loops_for(model, losses, size, stack)
    want = [alone(model, loop, rows) for loop, rows in zip(loops, runs)]
    got = together(model, loops, runs)
    assert slot_grads(model, 2) == [None] * len(slot_grads(model, 2))  # not in the round: no gradient
    for (want_sums, want_grads), got_sums, loop in zip(want, got, loops):
        assert got_sums.keys() == want_sums.keys()
        for key in want_sums:
            assert got_sums[key] == pytest.approx(want_sums[key], rel=1e-5, abs=1e-6), key
        for g, w in zip(slot_grads(model, loop.session.slot.index), want_grads):
            torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-4)
    assert "teacher_kl" in got[2] and "teacher_kl" not in got[0] and "ref_kl" in got[2]


@pytest.mark.parametrize("loss", ["aipo", "dppo", "grpo", "gspo", "cispo", "m2po"])
def test_the_chunked_head_trains_as_full_logits_do(model, runs, loss):
    """Every built-in loss, with an entropy bonus, reference KL, forward-KL targets and LoRA slots: the lm_head
    read 5 positions at a time gives the token sums and gradients of full logits (`"disabled"`)."""
    losses = [loss_config(loss), loss_config(loss) | {"entropy_coef": 0.01}, {"type": "cispo", "ref_kl": 0.1}]
    results = []
    for head in ("disabled", 5):
        loops = loops_for(model, losses, 4, True, head)
        sums = together(model, loops, runs)
        results.append((sums, [[g.clone() for g in slot_grads(model, loop.session.slot.index)] for loop in loops]))
    (want_sums, want_grads), (got_sums, got_grads) = results
    for want, got in zip(want_sums, got_sums):
        assert got.keys() == want.keys()
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
    for want, got in zip(want_grads, got_grads):
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-4)


def test_rows_of_several_runs_share_forwards_grouped_by_run(runs):
    planned = mixed_micro_batches(runs, 4)
    assert [sum(p.b - p.a for p in parts) for _, parts in planned] == [4, 4, 1]
    assert sum(len(parts) > 1 for _, parts in planned) >= 1  # some forward holds rows of several runs
    for mb, parts in planned:
        assert [p.a for p in parts] == [0] + [p.b for p in parts[:-1]] and parts[-1].b == mb.input_ids.shape[0]
        assert [p.run for p in parts] == sorted({p.run for p in parts})
        assert all(p.teacher == (p.run == 2) for p in parts)
        for p in parts:  # a run's slice is a batch of its own: its samples numbered from 0
            sub = mb.rows(p.a, p.b, p.teacher)
            assert sub.sample_ids.min() == 0 and sub.sample_ids.max() == sub.num_samples - 1
    concatenated = mixed_micro_batches(runs, 2, stack=False)
    assert all(len(parts) == 1 and mb.input_ids.shape[0] == 1 for mb, parts in concatenated)


def test_a_nan_run_leaves_the_others_gradients(model, runs):
    loops = loops_for(model, [{"type": "grpo"}] * 3, 4, True)
    want = alone(model, loops[0], runs[0])
    bad = [PackedRow(**{**vars(r), "advantages": torch.full_like(r.advantages, float("nan"))}) for r in runs[1]]
    got = together(model, loops, [runs[0], bad, runs[2]])
    assert got[1]["loss"] != got[1]["loss"] and got[0]["loss"] == pytest.approx(want[0]["loss"], rel=1e-5)
    for g, w in zip(slot_grads(model, loops[0].session.slot.index), want[1]):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-4)


def test_a_ready_run_waits_at_most_company_wait_rounds_for_the_others(monkeypatch):
    from asyncrl.trainer import runs as runs_module

    clock = [100.0]
    monkeypatch.setattr(runs_module.time, "monotonic", lambda: clock[0])
    trainer = runs_module.MultiRunTrainer.__new__(runs_module.MultiRunTrainer)
    trainer.config = SimpleNamespace(company_wait=1.0)
    trainer.runs, trainer.ready_since, trainer.round_s = dict.fromkeys(["a", "b", "c"]), {}, 2.0
    assert trainer._with_company(["a"], {}) == []  # b and c may come within one round (2 s)
    clock[0] += 1.5
    assert trainer._with_company(["a", "b"], {}) == []
    assert trainer._with_company(["a", "b"], {"c": "stopping"}) == ["a", "b"]  # no one else is coming
    assert trainer._with_company(["c"], {}) == []  # a and b were trained: c waits again
    clock[0] += 2.0
    assert trainer._with_company(["c"], {}) == ["c"]  # waited a round: goes alone
    trainer.config.company_wait = 0.0
    assert trainer._with_company(["a"], {}) == ["a"]
