"""The RL trainer end to end on a tiny model: 1 process in-process, and 2 FSDP2 processes (gloo) via torchrun.

Batches are synthetic but real-shaped: packed samples whose inference logprobs come from the base
model itself, so step 0 must see ratio 1 / mismatch_kl 0 through the whole FSDP2 forward.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from asyncrl.config.trainer import TrainerConfig
from asyncrl.core.errors import UserError
from asyncrl.trainer.loss import token_logprobs
from asyncrl.transport.batch import write_batch
from asyncrl.transport.layout import RunLayout, step_dirs
from asyncrl.transport.row import Row
from tests import warm

pytestmark = pytest.mark.slow


def synthetic_rows(model_dir: Path, samples: list[list[int]], seed: int) -> list[Row]:
    """One packed row per group of sample lengths; 3 prompt tokens per sample, μ from the base model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    rows = []
    for lengths in samples:
        n = sum(lengths)
        ids = torch.randint(0, 256, (n,), generator=g)
        pos = torch.cat([torch.arange(k) for k in lengths])
        temps = torch.cat([torch.full((k,), 0.9) for k in lengths])
        with torch.no_grad():
            logits = model(input_ids=ids[None], position_ids=pos[None], use_cache=False).logits[0]
            mu = token_logprobs(logits, ids, temps)
        mask = pos >= 3
        adv = torch.cat([torch.full((k,), float(torch.randn(1, generator=g))) for k in lengths]) * mask
        rows.append(Row(ids, pos, mask, adv, mu * mask, temps))
    return rows


def write_steps(model_dir: Path, out: Path, steps: range, ranks: int, layout: list[list[int]], **rank_layouts) -> None:
    """Every rank's rows packed as `layout`, or rank r's as `rank_layouts[f"rank{r}"]` where given."""
    for step in steps:
        layouts = [rank_layouts.get(f"rank{r}", layout) for r in range(ranks)]
        per_rank = [synthetic_rows(model_dir, layouts[r], seed=1000 * step + r) for r in range(ranks)]
        write_batch(RunLayout(out), step, per_rank)


# rank 1's rows differ so much in length that it plans a forward per row while rank 0 plans one for both:
# both must run as many forwards (the larger count), or FSDP's collectives would hang
RANK1 = [[100], [4]]


def config(model_dir: Path, out: Path, **overrides) -> TrainerConfig:
    data = {
        "model": {"name": str(model_dir)},
        "output_dir": str(out),
        "max_steps": 3,
        "max_async_level": 1,
        "optim": {"lr": 1e-3, "weight_decay": 0.0},
        "recv_timeout": 30,
    }
    for key, value in overrides.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    return TrainerConfig.model_validate(data)


def run_train(cfg: TrainerConfig) -> list[dict]:
    from asyncrl.trainer.rl import train

    torch.set_num_threads(1)
    return train(cfg, RunLayout.for_config(cfg))


def load_exported(path: Path):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert info["missing_keys"] == set() or not info["missing_keys"], info
    assert not info["unexpected_keys"], info
    return model


def test_single_process_trains_publishes_and_prunes(tiny_model_dir, tmp_path):
    write_steps(tiny_model_dir, tmp_path, range(3), 1, [[9, 7], [12]])
    history = run_train(config(tiny_model_dir, tmp_path))
    assert len(history) == 3
    assert history[0]["mismatch_kl"] < 1e-10 and history[0]["masked_frac"] == 0  # μ came from these weights
    assert history[1]["mismatch_kl"] > 0  # the policy moved
    assert history[0]["loss_tokens"] == (9 - 3) + (7 - 3) + (12 - 3) and history[0]["samples"] == 3
    # async window k=1: only steps 2 and 3 remain; the final step also lands in weights/
    assert sorted(step_dirs(tmp_path / "broadcast")) == [2, 3]
    assert all((d / "STABLE").exists() for d in step_dirs(tmp_path / "broadcast").values())
    assert (RunLayout(tmp_path).weights_dir(3) / "model.safetensors").exists()
    model = load_exported(RunLayout(tmp_path).broadcast_dir(3))
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    new = model.state_dict()
    assert any(not torch.equal(base[k], new[k]) for k in base)
    assert torch.equal(new["lm_head.weight"], new["model.embed_tokens.weight"])  # tie restored
    lines = (tmp_path / "metrics" / "trainer.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [0, 1, 2]
    assert sorted(step_dirs(tmp_path / "rollouts")) == [2]  # consumed batches are pruned


def test_gradient_does_not_depend_on_packing(tiny_model_dir, tmp_path):
    rows = synthetic_rows(tiny_model_dir, [[9, 7, 12]], seed=5)
    packed = tmp_path / "packed"
    write_batch(RunLayout(packed), 0, [rows])
    # the same three samples, one per row
    r = rows[0]
    split, start = [], 0
    for k in (9, 7, 12):
        split.append(r.map(lambda v, a=start, b=start + k: v[a:b]))
        start += k
    single = tmp_path / "single"
    write_batch(RunLayout(single), 0, [split])
    a = run_train(config(tiny_model_dir, packed, max_steps=1, optim={"max_norm": 0.0}))[0]
    b = run_train(config(tiny_model_dir, single, max_steps=1, optim={"max_norm": 0.0}))[0]
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    # activation checkpointing recomputes, it does not change the gradient
    write_batch(RunLayout(tmp_path / "ac"), 0, [rows])
    c = run_train(
        config(
            tiny_model_dir,
            tmp_path / "ac",
            max_steps=1,
            optim={"max_norm": 0.0},
            model={"name": str(tiny_model_dir), "ac": {"freq": 1}},
        )
    )[0]
    assert c["loss"] == a["loss"] and c["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-6)


def test_rows_per_forward_do_not_change_the_step_with_lora(tiny_model_dir, tmp_path):
    """data.micro_batch_size 1 (one row at a time) and 3 (rows stacked, padded) train LoRA identically."""
    rows = synthetic_rows(tiny_model_dir, [[9, 7], [12], [5, 4, 3]], seed=7)
    lora = {"name": str(tiny_model_dir), "lora": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}}
    runs = []
    for size in (1, 3):
        write_batch(RunLayout(tmp_path / str(size)), 0, [rows])
        cfg = config(tiny_model_dir, tmp_path / str(size), max_steps=1, model=lora, data={"micro_batch_size": size})
        runs.append(run_train(cfg)[0])
    assert runs[0]["loss"] == pytest.approx(runs[1]["loss"], rel=1e-5)
    assert runs[0]["grad_norm"] == pytest.approx(runs[1]["grad_norm"], rel=1e-4) and runs[0]["grad_norm"] > 0
    assert runs[0]["entropy"] == pytest.approx(runs[1]["entropy"], rel=1e-5)


@pytest.mark.parametrize("lora", [False, True], ids=["frozen-copy", "lora-adapters-off"])
def test_ref_kl_entropy_bonus_and_ratio_quantiles(tiny_model_dir, tmp_path, lora):
    """ref_kl: 0 while the policy is the start, then > 0 (a frozen copy, or a LoRA model with adapters off);
    the entropy bonus trains; the importance ratio's quantiles are logged every step (1 at step 0)."""
    write_steps(tiny_model_dir, tmp_path, range(3), 1, [[9, 7], [12]])
    model = {"name": str(tiny_model_dir)}
    if lora:
        model["lora"] = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    loss = {"type": "dppo", "kl_tau": 1e-3, "ref_kl": 0.1, "entropy_coef": 0.01, "token_is_cap": 2.0}
    history = run_train(config(tiny_model_dir, tmp_path, model=model, loss=loss, optim={"lr": 1e-2}))
    assert history[0]["ref_kl"] < 1e-9 and history[2]["ref_kl"] > 1e-6
    assert history[0]["importance_ratio/p50"] == pytest.approx(1.0, abs=1e-5)
    assert (
        history[0]["importance_ratio/p01"] <= history[0]["importance_ratio/p99"] <= history[0]["importance_ratio/max"]
    )
    assert history[2]["importance_ratio/max"] != pytest.approx(1.0, abs=1e-4)  # the policy moved
    assert {"trust_masked_high_frac", "trust_masked_low_frac", "token_truncated_frac"} <= history[1].keys()
    assert all(math.isfinite(h["loss"]) and h["grad_norm"] > 0 for h in history)


def test_nan_loss_stops_without_weights(tiny_model_dir, tmp_path):
    rows = synthetic_rows(tiny_model_dir, [[8]], seed=0)
    rows[0].advantages = torch.full_like(rows[0].advantages, float("nan"))
    write_batch(RunLayout(tmp_path), 0, [rows])
    with pytest.raises(UserError, match="loss is nan at step 0"):
        run_train(config(tiny_model_dir, tmp_path))
    assert not RunLayout(tmp_path).broadcast_dir(1).exists()


def test_lora_ac_bf16_export_merges(tiny_model_dir, tmp_path):
    write_steps(tiny_model_dir, tmp_path, range(1), 1, [[10, 8]])
    cfg = config(
        tiny_model_dir,
        tmp_path,
        max_steps=1,
        optim={"lr": 1e-2},
        model={
            "name": str(tiny_model_dir),
            "lora": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
            "ac": {"freq": 2},
            "optimization_dtype": "bfloat16",
        },
    )
    history = run_train(cfg)
    assert history[0]["grad_norm"] > 0
    # a zero-initialised B makes step 0's update touch only B; merged weights equal base until then
    new = load_exported(RunLayout(tmp_path).broadcast_dir(1)).state_dict()
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    assert set(new) - {"lm_head.weight"} == set(base)
    changed = {k for k in base if not torch.equal(base[k], new[k])}
    assert changed and all("q_proj" in k or "v_proj" in k for k in changed)


def test_ckpt_path_moves_the_checkpoints_and_resume_reads_them_there(tiny_model_dir, tmp_path):
    write_steps(tiny_model_dir, tmp_path, range(3), 1, [[9, 7], [12]])
    elsewhere = tmp_path.parent / f"{tmp_path.name}-ckpts"  # absolute, outside the output dir
    run_train(config(tiny_model_dir, tmp_path, max_steps=2, ckpt={"interval": 1, "path": str(elsewhere)}))
    assert sorted(step_dirs(elsewhere)) == [1, 2] and not (tmp_path / "checkpoints").exists()
    resumed = run_train(config(tiny_model_dir, tmp_path, ckpt={"path": str(elsewhere), "resume_step": -1}))
    assert len(resumed) == 1  # step 2 of max_steps 3, from elsewhere/step_2
    write_steps(tiny_model_dir, tmp_path, range(2), 1, [[9, 7], [12]])  # consumed by the first run
    run_train(config(tiny_model_dir, tmp_path, max_steps=2, ckpt={"interval": 1, "path": "mine"}))
    assert sorted(step_dirs(tmp_path / "mine")) == [1, 2]  # a relative path is under the output dir


def test_single_process_resume_retention_and_bad_checkpoints(tiny_model_dir, tmp_path):
    write_steps(tiny_model_dir, tmp_path, range(4), 1, [[9, 7], [12]])
    first = run_train(
        config(
            tiny_model_dir,
            tmp_path,
            max_steps=4,
            ckpt={"interval": 1, "keep_last": 2, "keep_interval": 2, "save_async": True},
        )
    )
    ckpts = sorted(step_dirs(tmp_path / "checkpoints"))
    assert ckpts == [2, 3, 4]  # last two plus multiples of 2
    final = load_file(str(RunLayout(tmp_path).broadcast_dir(4) / "model.safetensors"))
    write_steps(tiny_model_dir, tmp_path, range(2, 4), 1, [[9, 7], [12]])  # the orchestrator re-sends them
    resumed = run_train(config(tiny_model_dir, tmp_path, max_steps=4, ckpt={"interval": 10, "resume_step": 2}))
    assert len(resumed) == 2
    assert resumed[0]["loss"] == first[2]["loss"] and resumed[0]["grad_norm"] == first[2]["grad_norm"]
    assert resumed[1]["loss"] == first[3]["loss"]
    again = load_file(str(RunLayout(tmp_path).broadcast_dir(4) / "model.safetensors"))
    assert all(torch.equal(final[k], again[k]) for k in final)

    with pytest.raises(UserError, match=r"available steps: \[2, 3, 4\]"):
        run_train(config(tiny_model_dir, tmp_path, ckpt={"resume_step": 1}))
    ckpt3 = tmp_path / "checkpoints" / "step_3" / "trainer"
    (ckpt3 / "STABLE").unlink()
    with pytest.raises(UserError, match="step_3/trainer is partial or corrupted"):
        run_train(config(tiny_model_dir, tmp_path, ckpt={"resume_step": 3}))
    shard = next((tmp_path / "checkpoints" / "step_2" / "trainer").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(UserError, match="step_2/trainer is corrupted"):
        run_train(config(tiny_model_dir, tmp_path, ckpt={"resume_step": 2}))


def torchrun(out: Path, args: list[str], timeout: int = 300) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "asyncrl.entrypoints.trainer",
        *args,
    ]
    proc = warm.popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun's workers too
        output, _ = proc.communicate()
        pytest.fail(f"torchrun timed out after {timeout}s:\n{output[-5000:]}")
    assert proc.returncode == 0, output[-5000:]
    return output


def run_probe(module: str, ranks: int, args: list[str], out: Path, timeout: float | None = None) -> dict:
    """`torchrun --nproc-per-node RANKS -m MODULE ARGS` of a probe in this directory (tp_probe, ep_probe), one
    thread a rank; what it saved to `out`. Run as a module: a torchrun the tests fork forks `-m` ranks."""
    pythonpath = [str(Path(__file__).parent), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(pythonpath)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), "-m", module]
    proc = warm.run([*cmd, *args], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    return torch.load(out)


def read_metrics(out: Path) -> dict[int, dict]:
    rows = [json.loads(x) for x in (out / "metrics" / "trainer.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows}  # a resumed run appends: later lines win


def test_two_process_fsdp_trains_checkpoints_resumes_exactly(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    write_steps(tiny_model_dir, out, range(3), 2, [[9, 7], [12]], rank1=RANK1)
    common = [
        "--model.name",
        str(tiny_model_dir),
        "--output-dir",
        str(out),
        "--max-steps",
        "3",
        "--max-async-level",
        "1",
        "--optim.lr",
        "1e-3",
        "--recv-timeout",
        "60",
        "--data.micro-batch-size",
        "2",
    ]
    torchrun(out, common + ["--ckpt.interval", "2", "--ckpt.save-async"])
    first = read_metrics(out)
    assert first[0]["mismatch_kl"] < 1e-10 and first[0]["loss_tokens"] == (6 + 4 + 9) + (97 + 1)
    assert sorted(step_dirs(out / "checkpoints")) == [2, 3]
    final = load_file(str(RunLayout(out).broadcast_dir(3) / "model.safetensors"))
    load_exported(RunLayout(out).weights_dir(2))

    # the same step-0 samples on one rank give the same loss and gradient (normalisation across ranks)
    one = tmp_path / "one"
    rows = synthetic_rows(tiny_model_dir, [[9, 7], [12]], seed=0) + synthetic_rows(tiny_model_dir, RANK1, seed=1)
    write_batch(RunLayout(one), 0, [rows])
    alone = run_train(config(tiny_model_dir, one, max_steps=1))[0]
    assert alone["loss"] == pytest.approx(first[0]["loss"], rel=1e-5)
    assert alone["grad_norm"] == pytest.approx(first[0]["grad_norm"], rel=1e-4)

    write_steps(tiny_model_dir, out, range(2, 3), 2, [[9, 7], [12]], rank1=RANK1)
    torchrun(out, common + ["--ckpt.resume-step", "2"])
    resumed = read_metrics(out)
    assert resumed[2]["loss"] == first[2]["loss"] and resumed[2]["grad_norm"] == first[2]["grad_norm"]
    again = load_file(str(RunLayout(out).broadcast_dir(3) / "model.safetensors"))
    assert all(torch.equal(final[k], again[k]) for k in final)
    model = load_exported(RunLayout(out).broadcast_dir(3))
    assert model(torch.tensor([[1, 2, 3]])).logits.isfinite().all()


def shared_row(model_dir: Path, seed: int) -> Row:
    """A row with a group (prompt 6 + completion 5, continuations forking at 6 and 3) and a plain sample of 8;
    μ is the base model's logprob of the expanded row."""
    from transformers import AutoModelForCausalLM

    g = torch.Generator().manual_seed(seed)
    pos = torch.cat([torch.arange(11), torch.arange(6, 10), torch.arange(3, 8), torch.arange(8)])
    starts = [0, 11, 15, 20, 28]
    adv = torch.cat([torch.full((b - a,), float(torch.randn(1, generator=g))) for a, b in zip(starts, starts[1:])])
    zeros = torch.zeros(pos.shape)
    row = Row(torch.randint(0, 256, pos.shape, generator=g), pos, pos >= 6, zeros, zeros, torch.full(pos.shape, 0.9))
    plain = row.expanded()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ids, positions = plain.input_ids[None], plain.position_ids[None]
        logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits[0]
    source = replace(row, input_ids=torch.arange(pos.numel())).expanded().input_ids  # each plain token's own
    mu = torch.zeros(pos.shape)
    mu[source] = token_logprobs(logits, plain.input_ids, plain.temperatures)
    return replace(row, advantages=adv * row.loss_mask, inference_logprobs=mu * row.loss_mask)


@pytest.mark.parametrize(("attn", "dtype"), [("sdpa", "float32"), ("eager", "bfloat16")])
def test_shared_prefix_rows_train_like_their_expanded_rows(tiny_model_dir, tmp_path, attn, dtype):
    rows = [shared_row(tiny_model_dir, seed=s) for s in range(2)]
    model = {"name": str(tiny_model_dir), "attn_implementation": attn, "optimization_dtype": dtype}
    runs = []
    for name, batch in [("shared", rows), ("expanded", [r.expanded() for r in rows])]:
        write_batch(RunLayout(tmp_path / name), 0, [batch])
        cfg = config(tiny_model_dir, tmp_path / name, max_steps=1, model=model, data={"micro_batch_size": 2})
        runs.append(run_train(cfg)[0])
    shared, expanded = runs
    assert shared["tokens"] == 2 * 28 < expanded["tokens"] and shared["loss_tokens"] == expanded["loss_tokens"]
    assert shared["samples"] == expanded["samples"] == 2 * 4
    tol = 1e-5 if dtype == "float32" else 2e-2
    if dtype == "float32":
        assert shared["mismatch_kl"] < 1e-6
    for key in ("loss", "grad_norm", "entropy"):
        assert shared[key] == pytest.approx(expanded[key], rel=tol), key
