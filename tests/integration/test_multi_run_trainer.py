"""The multi-run trainer (`trainer.runs`) on a tiny model: several LoRA runs, one model, one process group.

Batches are the synthetic real-shaped ones of test_trainer_fsdp, written into each run's dir the way its
orchestrator would. What must hold: a run trains the same whether or not other runs share the trainer
(its adapter is bit-identical), runs with different settings end with different adapters, a run's
checkpoint resumes it alone and exactly, a run that fails or is stopped ends alone, and the exported adapter
is what `peft` loads. Two ranks (FSDP2, gloo) give the one-rank result.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from asyncrl.config.cli import to_toml
from asyncrl.config.trainer import TrainerConfig
from asyncrl.transport.batch import write_batch
from asyncrl.transport.layout import RunLayout, step_dirs
from tests import warm
from tests.integration.test_trainer_fsdp import synthetic_rows

pytestmark = pytest.mark.slow

ROWS = [[9, 7], [12]]


def add_run(out: Path, name: str, model: Path, steps: range, seed: int = 0, **settings) -> RunLayout:
    """Run `name`'s dir: its batches for `steps` (rows differ per run), then its run.toml."""
    run = RunLayout(out).run(name)
    for step in steps:
        write_batch(run, step, [synthetic_rows(model, ROWS, seed=seed + 1000 * step)])
    write_settings(run, **settings)
    return run


def write_settings(run: RunLayout, **settings) -> None:
    run.root.mkdir(parents=True, exist_ok=True)
    lines = []
    for key, value in settings.items():
        if isinstance(value, dict):
            lines.append(f"[{key}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in value.items()))
        else:
            lines.insert(0, f"{key} = {json.dumps(value)}\n")
    run.run_config.write_text("".join(lines))


def trainer_config(model: Path, out: Path, runs: list[str], slots: int = 2, **extra) -> TrainerConfig:
    data = {
        "model": {"name": str(model), "lora": {"rank": 4, "alpha": 8.0}},
        "output_dir": str(out),
        "max_steps": 3,
        "max_async_level": 1,
        "optim": {"lr": 1e-2, "weight_decay": 0.0},
        "max_concurrent_runs": slots,
        "runs": runs,
        **extra,
    }
    return TrainerConfig.model_validate(data)


def train(cfg: TrainerConfig) -> dict[str, list[dict]]:
    from asyncrl.trainer.rl import train as run

    torch.set_num_threads(1)
    return run(cfg, RunLayout.for_config(cfg))


def adapter(run: RunLayout, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run.broadcast_dir(step) / "adapter" / "adapter_model.safetensors"))


def status(run: RunLayout) -> dict:
    return json.loads(run.run_status.read_text())


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Equal up to float rounding: steps trained in shared forwards (rows batched with other runs' rows)."""
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-5) for k in a)


def test_runs_share_the_trainer_without_touching_each_other(tiny_model_dir, tmp_path):
    alone = add_run(tmp_path / "alone", "a", tiny_model_dir, range(3), seed=1)
    train(trainer_config(tiny_model_dir, tmp_path / "alone", ["a"]))

    both = tmp_path / "both"
    a = add_run(both, "a", tiny_model_dir, range(3), seed=1)
    b = add_run(both, "b", tiny_model_dir, range(3), seed=2, optim={"lr": 3e-3})
    results = train(trainer_config(tiny_model_dir, both, ["a", "b"]))

    assert status(a)["state"] == status(b)["state"] == "done" and status(a)["step"] == 3
    assert [m["lr"] for m in results["a"]] == [1e-2] * 3 and [m["lr"] for m in results["b"]] == [3e-3] * 3
    assert [m["runs_together"] for m in results["a"]] == [2] * 3  # every step in forwards shared with B
    assert close(adapter(a, 3), adapter(alone, 3))  # B's presence changed nothing of A
    assert not close(adapter(a, 3), adapter(b, 3))
    for run in (a, b):  # each run dir is a run dir of its own: policies, final weights, metrics, log
        assert sorted(step_dirs(run.broadcast)) == [2, 3]
        assert (run.weights_dir(3) / "adapter" / "adapter_config.json").exists()
        assert not list(run.broadcast_dir(3).glob("*.safetensors"))  # the adapter alone, no base weights
        assert [json.loads(x)["step"] for x in run.metrics_file("trainer").read_text().splitlines()] == [0, 1, 2]
        assert json.loads(run.trainer_world.read_text()) == {"world_size": 1}
    assert "run b started in adapter slot" in b.log_file("trainer").read_text()
    assert "[a]" not in b.log_file("trainer").read_text()


def test_exported_adapter_is_what_peft_loads(tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from asyncrl.trainer.lora import apply_multi_lora

    run = add_run(tmp_path, "a", tiny_model_dir, range(2), seed=3)
    train(trainer_config(tiny_model_dir, tmp_path, ["a"], max_steps=2, slots=1))
    tensors = adapter(run, 2)
    ids = torch.tensor([[5, 17, 3, 99, 42, 7]])
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    peft = PeftModel.from_pretrained(base, run.broadcast_dir(2) / "adapter")
    ours = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    _, names = apply_multi_lora(ours, 4, 8.0, 0.0, ["q_proj", "k_proj", "v_proj", "o_proj"], slots=1)
    params = dict(ours.named_parameters())
    with torch.no_grad():
        for name, key in names[0].items():
            params[name].copy_(tensors[key])
        torch.testing.assert_close(peft.eval()(ids).logits, ours.eval()(ids).logits, atol=1e-5, rtol=1e-5)
    assert any(v.abs().sum() > 0 for k, v in tensors.items() if "lora_B" in k)  # it trained


def test_a_checkpoint_resumes_its_run_alone_and_exactly(tiny_model_dir, tmp_path):
    straight = add_run(tmp_path / "straight", "b", tiny_model_dir, range(4), seed=4, max_steps=4)
    train(trainer_config(tiny_model_dir, tmp_path / "straight", ["b"]))

    out = tmp_path / "resumed"
    a = add_run(out, "a", tiny_model_dir, range(2), seed=5, max_steps=2)
    b = add_run(out, "b", tiny_model_dir, range(4), seed=4, max_steps=2, ckpt={"interval": 2})  # in slot 1
    train(trainer_config(tiny_model_dir, out, ["a", "b"]))
    a_files = {p: p.stat().st_mtime_ns for p in a.root.rglob("*")}
    b.run_status.unlink()  # admit B again, alone (so in slot 0): resume its checkpoint, two more steps
    write_settings(b, max_steps=4, ckpt={"interval": 2, "resume_step": -1})
    results = train(trainer_config(tiny_model_dir, out, ["b"]))

    assert len(results["b"]) == 2 and status(b) == {**status(b), "state": "done", "step": 4}
    assert close(adapter(b, 4), adapter(straight, 4))  # adapter, AdamW state and schedule all came back
    assert {p: p.stat().st_mtime_ns for p in a.root.rglob("*")} == a_files
    assert [json.loads(x)["step"] for x in b.metrics_file("trainer").read_text().splitlines()] == [0, 1, 2, 3]


def test_a_failing_or_stopped_run_ends_alone(tiny_model_dir, tmp_path):
    a = add_run(tmp_path, "a", tiny_model_dir, range(3), seed=6)
    bad = add_run(tmp_path, "bad", tiny_model_dir, range(1), seed=7)
    rows = synthetic_rows(tiny_model_dir, ROWS, seed=8)
    rows[0].advantages = torch.where(rows[0].loss_mask, float("nan"), 0.0)
    write_batch(bad, 1, [rows])
    quiet = add_run(tmp_path, "quiet", tiny_model_dir, range(1), seed=9)  # its orchestrator "died" after step 0
    (quiet.root / "STOP").write_text("its orchestrator died (exit code -9)\n")
    typo = RunLayout(RunLayout(tmp_path).run_dir("typo"))
    write_settings(typo, optim={"lrr": 1.0})
    results = train(trainer_config(tiny_model_dir, tmp_path, ["a", "bad", "quiet", "typo"], slots=4))

    assert status(a)["state"] == "done" and len(results["a"]) == 3
    assert status(bad)["state"] == "failed" and status(bad)["step"] == 1
    assert "loss is nan at step 1" in status(bad)["error"] and not bad.broadcast_dir(2).exists()
    assert status(quiet)["state"] == "stopped" and status(quiet)["error"] == "its orchestrator died (exit code -9)"
    assert status(typo)["state"] == "failed" and "lrr" in status(typo)["error"]


def test_bad_settings_are_one_line_errors(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="add --model.lora"):
        TrainerConfig.model_validate({"model": {"name": "x"}, "max_concurrent_runs": 2})
    with pytest.raises(ValueError, match="set max_concurrent_runs too"):
        TrainerConfig.model_validate({"model": {"name": "x"}, "runs": ["a"]})
    bad = RunLayout(RunLayout(tmp_path).run_dir("a"))
    bad.root.mkdir(parents=True)
    bad.run_config.write_text("max_steps = [")
    nothing = add_run(tmp_path, "b", tiny_model_dir, range(0), ckpt={"resume_step": -1})  # no checkpoint to resume
    good = add_run(tmp_path, "c", tiny_model_dir, range(3), seed=16)
    train(trainer_config(tiny_model_dir, tmp_path, ["a", "b", "c"], slots=1))
    assert "is not readable TOML" in status(bad)["error"]
    assert "no checkpoint" in status(nothing)["error"] and status(nothing)["state"] == "failed"
    assert status(good)["state"] == "done"  # in the one slot, after both failed to start


def test_two_ranks_give_the_one_rank_adapters(tiny_model_dir, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    for name, seed, settings in (("a", 10, {}), ("b", 11, {"optim": {"lr": 3e-3}})):
        add_run(one, name, tiny_model_dir, range(2), seed=seed, **settings)
        run = add_run(two, name, tiny_model_dir, range(0), **settings)
        for step in range(2):  # the same rows, half on each rank
            rows = synthetic_rows(tiny_model_dir, ROWS, seed=seed + 1000 * step)
            write_batch(run, step, [rows[:1], rows[1:]])
    train(trainer_config(tiny_model_dir, one, ["a", "b"], max_steps=2))
    path = tmp_path / "trainer.toml"
    path.write_text(to_toml(trainer_config(tiny_model_dir, two, ["a", "b"], max_steps=2)))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["-m", "asyncrl.entrypoints.trainer", "@", str(path)]
    proc = warm.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("a", "b"):
        run = RunLayout(RunLayout(two).run_dir(name))
        rows = [json.loads(x) for x in run.metrics_file("trainer").read_text().splitlines()]
        assert [r["runs_together"] for r in rows] == [2, 2]  # both ranks ran forwards of both runs' rows
        got = adapter(run, 2)
        want = adapter(RunLayout(RunLayout(one).run_dir(name)), 2)
        assert got.keys() == want.keys()
        for key in want:
            torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=1e-4)


def test_one_wandb_run_per_run(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    runs = [add_run(tmp_path, name, tiny_model_dir, range(2), seed=12) for name in ("a", "b")]
    train(trainer_config(tiny_model_dir, tmp_path, ["a", "b"], max_steps=2, wandb={"offline": True, "name": "x"}))
    for run in runs:  # each run its own W&B run (named x-a, x-b), in its own dir, both open at once
        (found,) = (run.root / "wandb").glob("offline-run-*")
        assert (found / "files").is_dir()


def test_more_runs_than_slots_wait_and_a_reused_slot_carries_nothing_over(tiny_model_dir, tmp_path):
    alone = add_run(tmp_path / "alone", "c", tiny_model_dir, range(2), seed=13)
    train(trainer_config(tiny_model_dir, tmp_path / "alone", ["c"], max_steps=2, slots=1))
    out = tmp_path / "queued"
    runs = [add_run(out, name, tiny_model_dir, range(2), seed=s) for name, s in (("a", 14), ("b", 15), ("c", 13))]
    results = train(trainer_config(tiny_model_dir, out, ["a", "b", "c"], max_steps=2, slots=2))
    assert all(status(r)["state"] == "done" for r in runs) and all(len(results[n]) == 2 for n in "abc")
    log = runs[2].log_file("trainer").read_text()
    assert "run c started in adapter slot" in log  # after a or b ended
    assert same(adapter(runs[2], 2), adapter(alone, 2))  # the slot's last tenant left nothing behind
