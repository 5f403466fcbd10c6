"""What the PRIME-RL docs' prose promises, run as the docs state it.

Each section is one item of issue 32 ("Seed parity, round 2"): a behaviour the PRIME-RL docs
(/work/shared/seeds/*.md) describe in prose, run with the docs' own lines, a tiny local model (the session's
`tiny_model_dir`) and the shipped CPU configs in place of hub models and GPUs. Kept cheap: command-line checks
are `--help` / `--dry-run` subprocesses (no model load); the runs are `rl` runs of 2-3 steps, marked slow.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from asyncrl.transport.layout import RunLayout, step_dirs
from asyncrl.transport.weights import weights_problem
from asyncrl.utils.process import free_port

REPO = Path(__file__).resolve().parents[2]
GUIDE = REPO / "examples" / "seeds" / "full_guide.toml"  # the guide's full config, verbatim


def entrypoint(name: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`uv run NAME ARGS` as the docs write it, run from the repository root."""
    cmd = [sys.executable, "-m", f"asyncrl.entrypoints.{name}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)


def dry_run(name: str, *args: str) -> dict:
    """The config `NAME ARGS --dry-run` resolves to (what each process would run with)."""
    done = entrypoint(name, *args, "--dry-run")
    assert done.returncode == 0, done.stderr
    return tomllib.loads(done.stdout)


def tiny_rl_config(path: Path, model: Path, out: Path, max_steps: int, extra: str = "") -> Path:
    """A config file like the guide's, shrunk to the tiny model on CPU: 2-3 short steps of reverse-text."""
    path.write_text(
        f'max_steps = {max_steps}\nseq_len = 128\nmax_async_level = 1\noutput_dir = "{out}"\n\n'
        f'[model]\nname = "{model}"\n\n'
        "[orchestrator]\nbatch_size = 16\nrollouts_per_example = 4\n\n"
        "[orchestrator.sampling]\nmax_tokens = 8\n\n"
        '[[orchestrator.env]]\nid = "reverse-text"\n\n'
        f'[inference]\n\n[inference.server]\nhost = "127.0.0.1"\nport = {free_port()}\n' + extra
    )
    return path


def metric_steps(out: Path, process: str) -> list[int]:
    rows = [json.loads(line) for line in (out / "metrics" / f"{process}.jsonl").read_text().splitlines() if line]
    return [r["step"] for r in rows if r.get("kind", "train") == "train"]


def ran(done: subprocess.CompletedProcess) -> str:
    return done.stdout[-3000:] + done.stderr[-3000:]


# ---- item 1: the guide's checkpoint section, then its resume line ----------------------------------------------
# training-and-evaluation-guide.md, "Checkpointing & Resuming": `[trainer.ckpt]` (interval / keep_last /
# keep_interval), then `uv run rl @ configs/prime-rl/my-config.toml --trainer.ckpt.resume-step 50`. In rl the
# checkpoint section is the run's: the orchestrator checkpoints beside the trainer, so the resume finds both.


@pytest.mark.slow
def test_guide_trainer_ckpt_section_then_its_resume_line(tiny_model_dir, tmp_path):
    out = tmp_path / "outputs"
    guide_block = "\n[trainer.ckpt]\ninterval = 1        # save every N steps\nkeep_last = 3\nkeep_interval = 50\n"
    config = tiny_rl_config(tmp_path / "my-config.toml", tiny_model_dir, out, 2, guide_block)
    first = entrypoint("rl", "@", str(config))
    assert first.returncode == 0, ran(first)
    assert (out / "checkpoints" / "step_2" / "orchestrator").is_dir() and (out / "weights" / "step_2").is_dir()

    resumed = entrypoint("rl", "@", str(config), "--trainer.ckpt.resume-step", "2", "--max-steps", "3")
    assert resumed.returncode == 0, ran(resumed)
    assert metric_steps(out, "orchestrator") == metric_steps(out, "trainer") == [0, 1, 2]  # continued at step 2
    assert (out / "weights" / "step_3").is_dir()


# ---- item 3: keep_last / keep_interval prune weights/ as well as checkpoints/ ------------------------------------
# prime-rl-docs.md: `uv run rl @ config.toml --ckpt --ckpt.interval 10 --ckpt.keep-last 3` (+ `--ckpt.keep-interval
# N`: "preserve checkpoints at every N steps permanently"); the guide: "Checkpoints are saved to
# outputs/weights/step_{N}/ and outputs/checkpoints/step_{N}/". The readme: weight checkpoints a resume needs are
# kept, the rest cleaned up.


@pytest.mark.slow
def test_keep_last_prunes_weight_exports_too(tiny_model_dir, tmp_path):
    out = tmp_path / "outputs"
    config = tiny_rl_config(tmp_path / "config.toml", tiny_model_dir, out, 4)
    done = entrypoint(
        "rl", "@", str(config), "--ckpt", "--ckpt.interval", "1", "--ckpt.keep-last", "1", "--ckpt.keep-interval", "2"
    )
    assert done.returncode == 0, ran(done)
    assert RunLayout(out).resumable_steps() == [2, 4]  # the last one plus multiples of 2
    assert sorted(step_dirs(out / "weights")) == [2, 4]  # weights/step_1 and step_3 pruned with their checkpoints
    assert all(weights_problem(out / "weights" / f"step_{s}") is None for s in (2, 4))  # the kept ones whole


# ---- item 4: --help shows the defaults each entrypoint really runs with; --dry-run what each process runs --------
# rl-sft-evals.md: "To see all available configuration options, run uv run sft --help" (and `rl --help`).


def help_default(text: str, flag: str) -> str:
    line = next(x for x in text.splitlines() if x.strip().startswith(f"{flag} "))
    return line.rsplit("(default: ", 1)[1].removesuffix(")")


def test_sft_help_shows_the_defaults_sft_runs_with():
    text = entrypoint("sft", "--help").stdout
    ran_with = dry_run("sft")  # a bare `sft`
    assert float(help_default(text, "--optim.lr")) == ran_with["optim"]["lr"] == 2e-5
    assert help_default(text, "--data.type") == repr(ran_with["data"]["type"]) == "'fake'"
    assert float(help_default(entrypoint("trainer", "--help").stdout, "--optim.lr")) == 1e-6  # RL's own


def test_rl_dry_run_prints_what_each_component_runs_with(tiny_model_dir):
    cfg = dry_run("rl", "@", str(GUIDE), "--trainer.model.name", str(tiny_model_dir))
    names = {cfg["model"]["name"]} | {cfg[c]["model"]["name"] for c in ("trainer", "orchestrator", "inference")}
    assert names == {str(tiny_model_dir)}  # no stale top-level [model] from the file


# ---- item 5: RLOO / OPO ("Training objectives: GRPO, GSPO, OPO, RLOO, CISPO") --------------------------------------
# Here they are advantage estimators: the loss flag names the option where they live, in one line.


@pytest.mark.parametrize("line", [("trainer", "--loss.type", "rloo"), ("rl", "--trainer.loss.type", "opo")])
def test_rloo_and_opo_as_a_loss_name_the_advantage_option(line):
    done = entrypoint(*line, "--dry-run")
    assert done.returncode == 2 and not done.stdout
    (message,) = done.stderr.strip().splitlines()
    assert message.startswith("error: ") and f"--orchestrator.advantage.type {line[-1]}" in message
    assert dry_run("rl", "--orchestrator.advantage.type", line[-1])["orchestrator"]["advantage"]["type"] == line[-1]


# ---- item 6: `async_level` (readme: "Each run with asynchrony level async_level ...") --------------------------------
# Accepted wherever max_async_level is: flag, TOML key, rl's propagation; both given and different: one line.


def test_async_level_is_max_async_level(tmp_path):
    assert dry_run("orchestrator", "--async-level", "0")["max_async_level"] == 0
    assert dry_run("trainer", "--async-level", "1")["max_async_level"] == 1
    toml = tmp_path / "rl.toml"
    toml.write_text("async_level = 1\n")
    cfg = dry_run("rl", "@", str(toml))
    assert cfg["max_async_level"] == cfg["trainer"]["max_async_level"] == cfg["orchestrator"]["max_async_level"] == 1
    cfg = dry_run("rl", "--trainer.async-level", "0")
    assert cfg["trainer"]["max_async_level"] == cfg["orchestrator"]["max_async_level"] == 0
    for args in (["--async-level", "1", "--max-async-level", "2"], ["@", str(toml), "--max-async-level", "2"]):
        done = entrypoint("rl", *args, "--dry-run")
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert "async_level" in done.stderr and "max_async_level" in done.stderr
