"""Tensor parallelism (`model.tp`) on 2 CPU ranks (gloo) against 1 rank: the same loss and gradients, the RL
trainer end to end (checkpoints resumed at another tp size), `rl` with 2 tensor-parallel trainer ranks, and a tp
that does not divide the ranks as one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_rl import rl_args, run_rl
from test_trainer_fsdp import config, read_metrics, run_probe, run_train, torchrun, write_steps

from asyncrl.core.errors import UserError
from asyncrl.transport.layout import RunLayout, step_dirs
from asyncrl.utils.process import free_port

pytestmark = pytest.mark.slow


def probe(model_dir: Path, ranks: int, tp: int, out: Path) -> dict:
    """Loss, full gradients and rank 0's q_proj shape of one forward/backward on `ranks` ranks at `tp`."""
    return run_probe("tp_probe", ranks, [str(model_dir), str(tp), str(out)], out, timeout=300)  # tp_probe.py here


def test_two_tp_ranks_compute_what_one_rank_computes(tiny_model_dir, tmp_path):
    one = probe(tiny_model_dir, 1, 1, tmp_path / "one.pt")
    two = probe(tiny_model_dir, 2, 2, tmp_path / "two.pt")
    assert two["local_q"] == [one["local_q"][0] // 2, one["local_q"][1]]  # really split: half the heads each
    assert abs(float(one["loss"]) - float(two["loss"])) < 1e-5
    assert one["grads"].keys() == two["grads"].keys()
    for name, grad in one["grads"].items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(two["grads"][name], grad, atol=1e-6, rtol=1e-4, msg=name)


def test_rl_trainer_with_tp_trains_and_resumes_at_another_tp(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    write_steps(tiny_model_dir, out, range(3), 1, [[9, 7], [12]])  # one data rank: both tp ranks read its rows
    common = ["--model.name", str(tiny_model_dir), "--output-dir", str(out), "--max-steps", "3"]
    common += ["--max-async-level", "1", "--optim.lr", "1e-3", "--recv-timeout", "60", "--model.tp", "2"]
    torchrun(out, [*common, "--ckpt.interval", "2"])
    first = read_metrics(out)
    assert first[0]["mismatch_kl"] < 1e-10 and first[0]["loss_tokens"] == 6 + 4 + 9
    assert sorted(step_dirs(out / "checkpoints")) == [2, 3]
    final = load_file(str(RunLayout(out).broadcast_dir(3) / "model.safetensors"))

    write_steps(tiny_model_dir, tmp_path / "alone", range(3), 1, [[9, 7], [12]])  # the same rows (seeded)
    alone = run_train(config(tiny_model_dir, tmp_path / "alone", ckpt={"interval": 2}))
    for step in range(3):
        assert alone[step]["loss"] == pytest.approx(first[step]["loss"], rel=1e-5)
        assert alone[step]["grad_norm"] == pytest.approx(first[step]["grad_norm"], rel=1e-4)
    write_steps(tiny_model_dir, tmp_path / "alone", range(2, 3), 1, [[9, 7], [12]])
    args = [*common[:2], "--output-dir", str(tmp_path / "alone"), *common[4:], "--ckpt.resume-step", "2"]
    torchrun(tmp_path / "alone", args)  # 1 rank -> tp 2
    assert read_metrics(tmp_path / "alone")[2]["loss"] == pytest.approx(alone[2]["loss"], rel=1e-5)

    write_steps(tiny_model_dir, out, range(2, 3), 1, [[9, 7], [12]])
    resumed = run_train(config(tiny_model_dir, out, ckpt={"resume_step": 2}))  # tp 2 -> 1 rank
    assert resumed[0]["loss"] == pytest.approx(first[2]["loss"], rel=1e-5)
    assert resumed[0]["grad_norm"] == pytest.approx(first[2]["grad_norm"], rel=1e-4)
    again = load_file(str(RunLayout(out).broadcast_dir(3) / "model.safetensors"))
    for key, value in final.items():
        torch.testing.assert_close(again[key], value, atol=1e-6, rtol=1e-5, msg=key)


def test_tp_that_does_not_divide_the_ranks_is_one_line(tiny_model_dir, tmp_path):
    write_steps(tiny_model_dir, tmp_path, range(1), 1, [[9, 7]])
    with pytest.raises(UserError, match=r"model.tp = 2 does not divide the 1 trainer rank\(s\)"):
        run_train(config(tiny_model_dir, tmp_path, model={"name": str(tiny_model_dir), "tp": 2}))
    run_train(config(tiny_model_dir, tmp_path, max_steps=1))  # no process group was left behind


def test_rl_with_two_tensor_parallel_trainer_ranks(tiny_model_dir, tmp_path):
    """`rl --trainer-cpu-processes 2 --trainer.model.tp 2`: the orchestrator packs for one data rank, and the
    trainer's step 0 sees the sampler's logprobs (its split forward computes what the engine's whole one did)."""
    out = tmp_path / "run"
    args = rl_args(tiny_model_dir, out, 2, free_port()) + ["--orchestrator.batch-size", "16"]
    args += ["--orchestrator.rollouts-per-example", "4", "--trainer-cpu-processes", "2", "--trainer.model.tp", "2"]
    done = run_rl(args, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    metrics = read_metrics(out)
    assert sorted(metrics) == [0, 1] and metrics[0]["mismatch_kl"] < 1e-6
    assert json.loads((out / "trainer_world.json").read_text()) == {"world_size": 1}
    assert "decoder layers split over 2 ranks" in (out / "logs" / "trainer.log").read_text()
