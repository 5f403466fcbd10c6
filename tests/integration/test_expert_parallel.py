"""Expert parallelism (`model.ep`) on 2 CPU ranks (gloo) against 1 rank: the same loss and gradients, the RL
trainer end to end (a checkpoint resumed at another ep size), `rl` with 2 expert-parallel trainer ranks replaying
the engine's routing, and the bad values of ep as one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_rl import rl_args, run_rl
from test_trainer_fsdp import config, read_metrics, run_probe, run_train, synthetic_rows, torchrun, write_steps

from asyncrl.core.errors import UserError
from asyncrl.transport.batch import write_batch
from asyncrl.transport.layout import RunLayout, step_dirs
from asyncrl.utils.process import free_port

pytestmark = pytest.mark.slow

LAYOUT = [[9, 7], [12]]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from asyncrl.utils.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("moe"), hidden_size=64, num_layers=2, experts=8)


def probe(model_dir: Path, ranks: int, out: Path) -> dict:
    """Loss, full gradients and rank 0's expert count of one forward/backward on `ranks` ranks at ep = ranks."""
    return run_probe("ep_probe", ranks, [str(model_dir), str(ranks), str(out)], out)  # tests/integration/ep_probe.py


def test_two_ep_ranks_compute_what_one_rank_computes(moe_dir, tmp_path):
    one = probe(moe_dir, 1, tmp_path / "one.pt")
    two = probe(moe_dir, 2, tmp_path / "two.pt")
    assert (one["local_experts"], two["local_experts"]) == (8, 4)  # really split: half the experts each
    assert abs(float(one["loss"]) - float(two["loss"])) < 1e-5
    assert one["grads"].keys() == two["grads"].keys()
    assert any("experts.gate_up_proj" in name for name in one["grads"])
    for name, grad in one["grads"].items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(two["grads"][name], grad, atol=1e-6, rtol=1e-4, msg=name)


def test_rl_trainer_with_ep_trains_and_resumes_on_one_rank(moe_dir, tmp_path):
    out = tmp_path / "run"
    write_steps(moe_dir, out, range(3), 2, LAYOUT)  # two data ranks: each ep rank reads its own rows
    common = ["--model.name", str(moe_dir), "--output-dir", str(out), "--max-steps", "3", "--model.ep", "2"]
    common += ["--max-async-level", "1", "--optim.lr", "1e-3", "--recv-timeout", "60", "--ckpt.interval", "2"]
    torchrun(out, common)
    first = read_metrics(out)
    assert first[0]["mismatch_kl"] < 1e-10 and first[0]["loss_tokens"] == 2 * (6 + 4 + 9)
    assert sorted(step_dirs(out / "checkpoints")) == [2, 3]
    final = load_file(str(RunLayout(out).broadcast_dir(3) / "model.safetensors"))
    assert final["model.layers.0.mlp.experts.7.down_proj.weight"].shape == (64, final_width(final))  # all 8 experts

    for step in (0, 2):  # the same rows on one rank (no ep): step 0 afresh, step 2 resumed from ep 2's checkpoint
        rows = [r for rank in range(2) for r in synthetic_rows(moe_dir, LAYOUT, seed=1000 * step + rank)]
        write_batch(RunLayout(out if step else tmp_path / "one"), step, [rows])
    alone = run_train(config(moe_dir, tmp_path / "one", model={"name": str(moe_dir)}, max_steps=1))[0]
    assert alone["loss"] == pytest.approx(first[0]["loss"], rel=1e-5)
    assert alone["grad_norm"] == pytest.approx(first[0]["grad_norm"], rel=1e-4)
    resumed = run_train(config(moe_dir, out, ckpt={"resume_step": 2}))
    assert resumed[0]["loss"] == pytest.approx(first[2]["loss"], rel=1e-5)
    assert resumed[0]["grad_norm"] == pytest.approx(first[2]["grad_norm"], rel=1e-4)
    again = load_file(str(RunLayout(out).broadcast_dir(3) / "model.safetensors"))
    assert again.keys() == final.keys()
    for key, value in final.items():
        torch.testing.assert_close(again[key], value, atol=1e-6, rtol=1e-5, msg=key)


def final_width(state: dict[str, torch.Tensor]) -> int:
    """The experts' intermediate width, read from expert 0."""
    return state["model.layers.0.mlp.experts.0.down_proj.weight"].shape[1]


@pytest.mark.parametrize(
    ("model", "ep", "message"),
    [
        ("moe", 3, r"model.ep = 3 does not divide the model's 8 experts"),
        ("moe", 2, r"model.ep = 2 does not divide the 1 trainer rank\(s\)"),
        ("dense", 1, r"model.ep = 1: expert parallelism needs a mixture-of-experts model"),
    ],
)
def test_bad_ep_is_one_line(moe_dir, tiny_model_dir, tmp_path, model, ep, message):
    from asyncrl.trainer.ep import check_ep
    from asyncrl.trainer.model import _load_hf

    if ep != 2:  # what the model allows: refused once the model is loaded, before any rank splits it
        with pytest.raises(UserError, match=message):
            check_ep(_load_hf(str(moe_dir if model == "moe" else tiny_model_dir), "sdpa", False)[0], ep)
        return
    write_steps(moe_dir, tmp_path, range(1), 1, LAYOUT)
    with pytest.raises(UserError, match=message):
        run_train(config(moe_dir, tmp_path, model={"name": str(moe_dir), "ep": ep}))


def test_rl_with_two_expert_parallel_trainer_ranks(moe_dir, tmp_path):
    """`rl --trainer-cpu-processes 2 --trainer.model.ep 2 --trainer.model.router-replay`: the orchestrator packs for
    two data ranks, each trainer rank holds 4 of the 8 experts, routing replay and router load work across the
    exchange, and step 0 sees the sampler's logprobs."""
    out = tmp_path / "run"
    args = rl_args(moe_dir, out, 2, free_port()) + ["--orchestrator.batch-size", "16"]
    args[args.index("--max-async-level") + 1] = "0"  # the sampler's weights are the trainer's: mismatch is numerics
    args += ["--orchestrator.rollouts-per-example", "4", "--trainer-cpu-processes", "2", "--trainer.model.ep", "2"]
    done = run_rl([*args, "--trainer.model.router-replay"], timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    metrics = read_metrics(out)
    assert sorted(metrics) == [0, 1] and metrics[0]["mismatch_kl"] < 1e-6
    for m in metrics.values():
        assert m["moe/replay_agreement"] >= 0.99 and m["moe/load_max_over_mean"] >= 1.0, m
    assert json.loads((out / "trainer_world.json").read_text()) == {"world_size": 2}
    assert "each rank holds 1/2 of every layer's experts" in (out / "logs" / "trainer.log").read_text()
