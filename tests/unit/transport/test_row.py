"""The packed row type and its wire form: round trips, the on-disk format unchanged, malformed rows refused."""

from dataclasses import replace

import pytest
import torch

from asyncrl.core.errors import UserError
from asyncrl.transport.batch import read_batch, write_batch
from asyncrl.transport.layout import RunLayout
from asyncrl.transport.row import Row


def row(n: int = 6) -> Row:
    """Two samples of n // 2 tokens, the second half of each a completion."""
    pos = torch.arange(n // 2).repeat(2)
    mask = pos >= n // 4
    return Row(
        input_ids=torch.arange(n) + 5,
        position_ids=pos,
        loss_mask=mask,
        advantages=torch.where(mask, 0.5, 0.0),
        inference_logprobs=torch.where(mask, -2.0, 0.0),
        temperatures=torch.full((n,), 0.7),
    )


def distilled(r: Row, width: int = 2) -> Row:
    n = r.input_ids.numel()
    return replace(r, teacher_ids=torch.arange(n * width).view(n, width), teacher_targets=torch.rand(n, width))


def same(a: Row, b: Row) -> bool:
    wa, wb = a.to_wire(), b.to_wire()
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) and wa[k].dtype == wb[k].dtype for k in wa)


@pytest.mark.parametrize("make", [row, lambda: distilled(row())], ids=["plain", "forward_kl"])
def test_a_row_round_trips_through_its_wire_form_and_the_batch_files(tmp_path, make):
    r = make()
    assert same(Row.from_wire(r.to_wire(), vocab_size=100), r)
    write_batch(RunLayout(tmp_path), 2, [[r, r.masked()]])
    back = read_batch(RunLayout(tmp_path), 2, 0, vocab_size=100)
    assert len(back) == 2 and same(back[0], r) and same(back[1], r.masked())


def test_the_wire_form_is_the_dict_of_prime_rl_names_already_on_disk(tmp_path):
    """A batch file written as a literal dict (the format before the type) reads back; extra keys are ignored."""
    fields = ["input_ids", "position_ids", "loss_mask", "advantages", "inference_logprobs", "temperatures"]
    assert list(row().to_wire()) == fields  # no teacher keys unless the row has targets
    assert list(distilled(row()).to_wire()) == [*fields, "teacher_ids", "teacher_targets"]
    wire = {**row().to_wire(), "extra": torch.zeros(1)}
    step_dir = RunLayout(tmp_path).batch_dir(0)
    step_dir.mkdir(parents=True)
    torch.save({"step": 0, "micro_batches": [wire]}, step_dir / "rank_0.pt")
    assert same(read_batch(RunLayout(tmp_path), 0, 0)[0], row())


def test_a_malformed_batch_file_is_refused_with_the_file_and_the_first_thing_wrong(tmp_path):
    wire = row().to_wire()
    del wire["advantages"]
    step_dir = RunLayout(tmp_path).batch_dir(0)
    step_dir.mkdir(parents=True)
    torch.save({"step": 0, "micro_batches": [row().to_wire(), wire]}, step_dir / "rank_0.pt")
    with pytest.raises(UserError, match=r"rank_0.pt is malformed: micro-batch 1: lacks the fields \['advantages'\]"):
        read_batch(RunLayout(tmp_path), 0, 0)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda w: [1, 2], "a list, not a dict of tensors"),
        (lambda w: w | {"input_ids": w["input_ids"].float()}, "wrong dtypes {'input_ids': 'float32'}"),
        (lambda w: w | {"advantages": w["advantages"][:-1]}, "non-empty 1-D tensors of one length"),
        (lambda w: w | {"input_ids": w["input_ids"] + 100}, r"input_ids\[0\] = 105 is outside"),
        (lambda w: w | {"temperatures": torch.zeros(6)}, r"temperatures\[0\] = 0.0"),
        (lambda w: w | {"teacher_ids": torch.zeros(6, 2, dtype=torch.long)}, "teacher_ids without teacher_targets"),
    ],
)
def test_from_wire_refuses_what_is_not_the_format(change, words):
    with pytest.raises(ValueError, match=words):
        Row.from_wire(change(row().to_wire()), vocab_size=100)


def test_rows_built_in_process_are_checked_for_shape_when_written(tmp_path):
    bad = replace(row(), temperatures=torch.ones(5))
    with pytest.raises(ValueError, match="packed row: the fields must be non-empty 1-D tensors of one length"):
        write_batch(RunLayout(tmp_path), 0, [[bad]])
    assert not RunLayout(tmp_path).batch_dir(0).exists()


def test_a_filler_keeps_the_tokens_and_nothing_to_train_on():
    r = distilled(row())
    filler = r.masked()
    assert torch.equal(filler.input_ids, r.input_ids) and torch.equal(filler.teacher_ids, r.teacher_ids)
    assert not filler.loss_mask.any() and not filler.advantages.any() and not filler.teacher_targets.any()
    assert not filler.inference_logprobs.any() and torch.equal(filler.temperatures, r.temperatures)


def test_to_moves_every_field_into_the_dtype_of_the_format():
    r = replace(row(), input_ids=row().input_ids.int(), advantages=row().advantages.double())
    moved = r.to(torch.device("cpu"))
    assert moved.input_ids.dtype == torch.long and moved.advantages.dtype == torch.float32
    assert torch.equal(moved.input_ids, row().input_ids) and moved.teacher_ids is None
