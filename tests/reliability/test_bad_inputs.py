"""The trainer's and orchestrator's own inputs, malformed: rollout batches that are not the wire format, steps
that would train nonsense, damaged or missing checkpoints, weights cut short. Each ends in one line naming the
file and what is wrong (exit 2, no traceback) or, for a step with no loss tokens, a loud warning and a no-op.

The trainer runs as the user runs it (its entrypoint in a subprocess, 2 ranks under torchrun for the case where
one rank's file is bad); each batch case is one trainer process on the tiny model, max_steps 1.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from asyncrl.core.errors import UserError
from asyncrl.orchestrator import ckpt
from asyncrl.trainer.rl.data import RolloutSource
from asyncrl.transport.layout import RunLayout, resolve_resume_step, trainer_world_size
from asyncrl.transport.weights import weights_problem
from tests import warm

pytestmark = pytest.mark.reliability

TRAINER = [sys.executable, "-m", "asyncrl.entrypoints.trainer"]
LENGTH = 12


def good_row() -> dict[str, torch.Tensor]:
    """One packed row of two samples (prompt 3 tokens each), as the orchestrator writes it."""
    pos = torch.cat([torch.arange(6), torch.arange(6)])
    mask = pos >= 3
    return {
        "input_ids": torch.arange(LENGTH) + 5,
        "position_ids": pos,
        "loss_mask": mask,
        "advantages": torch.where(mask, 1.0, 0.0),
        "inference_logprobs": torch.where(mask, -5.0, 0.0),
        "temperatures": torch.ones(LENGTH),
    }


def with_row(change: Callable[[dict], None]) -> Callable[[], object]:
    def payload() -> object:
        row = good_row()
        change(row)
        return {"step": 0, "micro_batches": [row]}

    return payload


def _set(field: str, index: int, value) -> Callable[[dict], None]:
    return lambda row: row[field].__setitem__(index, value)


def _teacher(length: int, at: int | None = None, ids: int = 1, mass: float = 0.5) -> Callable[[dict], None]:
    """Forward-KL targets of width 2, `ids` / `mass` at row `at` (None: 1-D fields, a shape error)."""

    def change(row: dict) -> None:
        if at is None:
            row.update(teacher_ids=torch.ones(length, dtype=torch.long), teacher_targets=torch.ones(length))
            return
        row["teacher_ids"], row["teacher_targets"] = torch.ones(length, 2, dtype=torch.long), torch.zeros(length, 2)
        row["teacher_ids"][at, 0], row["teacher_targets"][at, 0] = ids, mass

    return change


# case -> (what rank_0.pt holds, the words the error must contain)
BAD_BATCHES = {
    "not_a_dict": (lambda: [good_row()], "holds a list, not a dict"),
    "micro_batches_not_a_list": (lambda: {"step": 0, "micro_batches": good_row()}, "micro_batches is a dict"),
    "zero_micro_batches": (lambda: {"step": 0, "micro_batches": []}, "holds no micro-batches"),
    "missing_field": (with_row(lambda r: r.pop("advantages")), "lacks the fields ['advantages']"),
    "wrong_step": (lambda: {"step": 7, "micro_batches": [good_row()]}, "says step 7"),
    "field_not_a_tensor": (with_row(lambda r: r.update(input_ids=list(range(LENGTH)))), "not tensors"),
    "length_mismatch": (with_row(lambda r: r.update(advantages=r["advantages"][:-1])), "one length"),
    "two_dimensional": (with_row(lambda r: r.update({k: v[None] for k, v in r.items()})), "1-D"),
    "float_token_ids": (with_row(lambda r: r.update(input_ids=r["input_ids"].float())), "wrong dtypes"),
    "out_of_vocabulary": (with_row(_set("input_ids", 4, 10**6)), "input_ids[4] = 1000000 is outside"),
    "negative_token_id": (with_row(_set("input_ids", 2, -1)), "input_ids[2] = -1 is outside"),
    "nan_sampler_logprob": (with_row(_set("inference_logprobs", 7, float("nan"))), "inference_logprobs[7] = nan"),
    "inf_sampler_logprob": (with_row(_set("inference_logprobs", 9, float("-inf"))), "inference_logprobs[9] = -inf"),
    "zero_temperature": (with_row(_set("temperatures", 0, 0.0)), "temperatures[0] = 0.0"),
    "teacher_ids_alone": (
        with_row(lambda r: r.update(teacher_ids=torch.zeros(LENGTH, 2, dtype=torch.long))),
        "has teacher_ids without teacher_targets",
    ),
    "teacher_fields_one_dimensional": (with_row(_teacher(LENGTH, None)), "teacher fields must be (L, K) tensors"),
    "teacher_id_out_of_vocabulary": (with_row(_teacher(LENGTH, 3, ids=10**6)), "teacher_ids[3] = [1000000"),
    "float_teacher_ids": (
        with_row(lambda r: r.update(teacher_ids=torch.ones(LENGTH, 2), teacher_targets=torch.zeros(LENGTH, 2))),
        "wrong dtypes {'teacher_ids': 'float32'}",
    ),
    "negative_teacher_mass": (with_row(_teacher(LENGTH, 5, mass=-0.5)), "teacher_targets[5] = [-0.5"),
    "loss_on_a_shared_prefix": (
        with_row(lambda r: r.update(position_ids=torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 4, 5, 6, 7]))),
        "a shared prefix holds loss tokens",
    ),
}
BAD_META = {"garbage_meta": ("{not json", "unreadable (JSONDecodeError"), "meta_not_a_dict": ("[1]", "holds a list")}


def write_raw_batch(out: Path, per_rank: list[object], meta: str | None = None) -> Path:
    """Step 0's batch dir holding exactly `per_rank` (as `torch.save` writes them) and `meta` (default: valid)."""
    step_dir = RunLayout(out).batch_dir(0)
    step_dir.mkdir(parents=True)
    for rank, data in enumerate(per_rank):
        torch.save(data, step_dir / f"rank_{rank}.pt")
    info = {"step": 0, "num_ranks": len(per_rank), "micro_batches_per_rank": 1}
    (step_dir / "meta.json").write_text(meta if meta is not None else json.dumps(info))
    return step_dir


def trainer_args(model: Path, out: Path) -> list[str]:
    return ["--model.name", str(model), "--output-dir", str(out), "--max-steps", "1", "--recv-timeout", "30"]


def run(cmd: list[str], timeout: int = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return warm.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(proc: subprocess.CompletedProcess, *words: str) -> str:
    """Exit 2, no traceback, and one `error:` line containing every one of `words`; returns that line."""
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1, (proc.returncode, proc.stderr[-3000:])
    assert all(w in errors[0] for w in words), errors[0]
    return errors[0]


def write_case(out: Path, case: str) -> tuple[Path, str]:
    """Step 0's batch of `case` under `out`: the file the error must name, and the words it must say."""
    if case in BAD_META:
        meta, words = BAD_META[case]
        return write_raw_batch(out, [{"step": 0, "micro_batches": [good_row()]}], meta) / "meta.json", words
    payload, words = BAD_BATCHES[case]
    return write_raw_batch(out, [payload()]) / "rank_0.pt", words


@pytest.mark.parametrize("case", [*BAD_BATCHES, *BAD_META])
def test_every_malformed_batch_is_refused_where_the_trainer_reads_it(tiny_model_dir, tmp_path, case):
    """All cases at the trainer's read boundary, in this process (fast); the trainer itself: the next test."""
    named, words = write_case(tmp_path, case)
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    with pytest.raises(UserError) as got:
        RolloutSource(RunLayout(tmp_path), 0, 1, timeout=5, vocab_size=vocab).get(0)
    message = str(got.value)
    assert str(named) in message and words in message and "\n" not in message, message
    assert f"Delete {named.parent} and restart the orchestrator" in message


# one trainer process per kind of check: structure, fields, shapes, vocabulary, sampler logprobs, meta.json
TRAINER_CASES = ["not_a_dict", "missing_field", "length_mismatch", "out_of_vocabulary", "inf_sampler_logprob"]


@pytest.mark.slow  # a trainer process each (~5 CPU s, 10-15 s with the suite around it)
@pytest.mark.parametrize("case", [*TRAINER_CASES, "garbage_meta"])
def test_the_trainer_stops_on_a_malformed_batch_with_one_line_naming_the_file(tiny_model_dir, tmp_path, case):
    named, words = write_case(tmp_path, case)
    proc = run(TRAINER + trainer_args(tiny_model_dir, tmp_path))
    line = assert_one_line_error(proc, str(named), words)
    assert f"Delete {named.parent} and restart the orchestrator" in line
    assert not RunLayout(tmp_path).broadcast_dir(1).exists()


@pytest.mark.slow  # a trainer process each (~5 CPU s, 10-15 s with the suite around it)
def test_a_step_without_loss_tokens_is_a_loud_no_op_that_still_publishes(tiny_model_dir, tmp_path):
    row = good_row()
    row["loss_mask"] = torch.zeros(LENGTH, dtype=torch.bool)
    row["advantages"] = row["inference_logprobs"] = torch.zeros(LENGTH)
    step_dir = write_raw_batch(tmp_path, [{"step": 0, "micro_batches": [row]}])
    proc = run(TRAINER + trainer_args(tiny_model_dir, tmp_path))
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    warned = [line for line in (proc.stdout + proc.stderr).splitlines() if "has no loss tokens on any rank" in line]
    assert len(warned) == 1 and "step 0:" in warned[0] and str(step_dir) in warned[0], warned
    published = RunLayout(tmp_path).broadcast_dir(1)
    assert (published / "STABLE").exists()  # the orchestrator waiting for step_1 goes on
    base, after = load_file(str(tiny_model_dir / "model.safetensors")), load_file(str(published / "model.safetensors"))
    assert all(torch.equal(base[k], after[k]) for k in after)  # no optimizer step: not even weight decay
    metrics = json.loads((tmp_path / "metrics" / "trainer.jsonl").read_text().splitlines()[0])
    assert metrics["step"] == 0 and metrics["empty_step"] == 1 and metrics["loss_tokens"] == 0


@pytest.mark.slow  # a trainer process each (~5 CPU s, 10-15 s with the suite around it)
def test_two_ranks_agree_when_one_rank_file_is_malformed(tiny_model_dir, tmp_path):
    """Rank 1's file has a non-finite sampler logprob, rank 0's is fine: both stop with rank 1's line, no hang."""
    bad = good_row()
    bad["inference_logprobs"][5] = float("inf")
    step_dir = write_raw_batch(
        tmp_path, [{"step": 0, "micro_batches": [good_row()]}, {"step": 0, "micro_batches": [bad]}]
    )
    logs = tmp_path / "ranks"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    torchrun += ["--log-dir", str(logs), "--redirects", "3", "-m", "asyncrl.entrypoints.trainer"]
    proc = run(torchrun + trainer_args(tiny_model_dir, tmp_path))
    assert proc.returncode != 0
    stderrs = sorted(logs.rglob("stderr.log"))
    assert len(stderrs) == 2, stderrs
    for path in stderrs:  # each rank: its own one line, rank 1's problem, no traceback
        text = path.read_text()
        errors = [line for line in text.splitlines() if line.startswith("error: ")]
        assert "Traceback" not in text and len(errors) == 1, text[-3000:]
        assert f"rank 1: rollout batch {step_dir / 'rank_1.pt'} is malformed" in errors[0], errors[0]
        assert "inference_logprobs[5] = inf" in errors[0]


@pytest.mark.slow  # a trainer process each (~5 CPU s, 10-15 s with the suite around it)
def test_truncated_weights_are_one_line_naming_them(tiny_model_dir, tmp_path):
    """A run's weights/step_N cut short (a disk fault), given as the model to start from."""
    weights = tmp_path / "weights" / "step_2"
    weights.mkdir(parents=True)
    for f in tiny_model_dir.iterdir():
        (weights / f.name).write_bytes(f.read_bytes())
    shard = weights / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    write_raw_batch(tmp_path / "run", [{"step": 0, "micro_batches": [good_row()]}])
    proc = run(TRAINER + trainer_args(weights, tmp_path / "run"))
    assert_one_line_error(proc, str(weights), "truncated or corrupted")


# ---- the orchestrator's checkpoint, and resuming when part of a checkpoint is missing -------------------------


@pytest.mark.parametrize(
    "progress",
    [
        {"step": 2, "total_tokens": "many"},
        {"step": "2"},
        {"step": 2, "sampler": [1, 2]},
        {"step": 2, "total_samples": None},
        {"step": 2, "total_problems": True},
        [2],
    ],
)
def test_orchestrator_progress_with_wrong_types_is_named(tmp_path, progress):
    layout = RunLayout(tmp_path)
    path = ckpt.save(layout, ckpt.Progress(step=2), [])
    (path / ckpt.PROGRESS).write_text(json.dumps(progress))
    with pytest.raises(UserError, match=rf"orchestrator checkpoint {path} is corrupted .*progress.json.*another step"):
        ckpt.load(layout, 2)


def complete_trainer_checkpoint(layout: RunLayout, step: int) -> None:
    path = layout.checkpoint_dir(step, "trainer")
    path.mkdir(parents=True)
    (path / "STABLE").write_text("")


def test_a_missing_orchestrator_checkpoint_is_named_not_the_complete_trainer_one(tmp_path):
    layout = RunLayout(tmp_path)
    for step in (2, 4):
        complete_trainer_checkpoint(layout, step)
    ckpt.save(layout, ckpt.Progress(step=2), [])  # step 4's orchestrator part is missing
    missing = layout.checkpoint_dir(4, "orchestrator")
    with pytest.raises(UserError, match=rf"no orchestrator checkpoint at {missing} \(the trainer's step_4 is complete"):
        resolve_resume_step(layout, 4)
    assert resolve_resume_step(layout, -1) == 2
    shutil.rmtree(layout.checkpoint_dir(2, "orchestrator"))
    ckpt.save(layout, ckpt.Progress(step=6), [])  # the orchestrator ran ahead; its steps 2 and 4 are gone
    with pytest.raises(
        UserError,
        match=r"-1 but no checkpoint under .* is complete .*checkpoints \[2, 4\] lack the orchestrator's part",
    ):
        resolve_resume_step(layout, -1)


# ---- beyond files the trainer reads: the run dir's trainer_world.json, read by the orchestrator every step ---------


@pytest.mark.parametrize("content", ['{"world_size": "2"}', '{"world_size": 0}', "{}", "[2]", "{not json", ""])
def test_a_malformed_trainer_world_file_is_named(tmp_path, content):
    layout = RunLayout(tmp_path)
    assert trainer_world_size(layout) is None  # not written yet: the orchestrator packs for 1 rank meanwhile
    layout.trainer_world.write_text(content)
    with pytest.raises(UserError, match=rf"{layout.trainer_world} is malformed .* delete it .*num_train_workers"):
        trainer_world_size(layout)
    layout.trainer_world.write_text('{"world_size": 2}')
    assert trainer_world_size(layout) == 2


# ---- published weights cut short: found from the safetensors headers, healed by the trainer at resume -------------


def test_cut_weights_are_found_from_their_headers(tiny_model_dir, tmp_path):
    weights = tmp_path / "step_1"
    shutil.copytree(tiny_model_dir, weights)
    assert weights_problem(weights) is None
    shard = weights / "model.safetensors"
    whole = shard.read_bytes()
    for cut, words in [(len(whole) - 1, f"of {len(whole)} bytes"), (100, "header of"), (3, "not even a header")]:
        shard.write_bytes(whole[:cut])
        assert weights_problem(weights).startswith(f"{shard} is truncated"), weights_problem(weights)
        assert words in weights_problem(weights)


def test_a_resumed_trainer_publishes_damaged_broadcast_weights_again(tiny_model_dir, tmp_path, caplog_loguru):
    from asyncrl.config.trainer import TrainerConfig
    from asyncrl.trainer.rl import train as train_in

    train = lambda cfg: train_in(cfg, RunLayout.for_config(cfg))  # noqa: E731  (as its entrypoint runs it)

    def config(**over) -> TrainerConfig:
        args = {"model": {"name": str(tiny_model_dir)}, "output_dir": str(tmp_path), "recv_timeout": 30}
        return TrainerConfig.model_validate(args | over)

    write_raw_batch(tmp_path, [{"step": 0, "micro_batches": [good_row()]}])
    train(config(max_steps=1, ckpt={"interval": 1}))
    shard = RunLayout(tmp_path).broadcast_dir(1) / "model.safetensors"
    whole = shard.read_bytes()
    shard.write_bytes(whole[: len(whole) // 2])
    batch = {"step": 1, "micro_batches": [good_row()]}
    RunLayout(tmp_path).batch_dir(1).mkdir(parents=True)
    torch.save(batch, RunLayout(tmp_path).batch_dir(1) / "rank_0.pt")
    (RunLayout(tmp_path).batch_dir(1) / "meta.json").write_text('{"step": 1, "num_ranks": 1}')
    train(config(max_steps=2, ckpt={"interval": 1, "resume_step": 1}))
    assert any("broadcast weights of step 1 are damaged" in m and str(shard) in m for m in caplog_loguru)
    assert weights_problem(shard.parent) is None and shard.read_bytes() == whole
