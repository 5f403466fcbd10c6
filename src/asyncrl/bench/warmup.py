"""The bench job's starting model: a tiny Qwen3 built here and SFT-warmed on reverse-text, cached by its settings.

One job: make sure `{output_dir}/warmup/{key}/model` holds the warmed model (`ensure_warm_model`), and
say whether it was reused. Every torch-heavy stage runs as a child process (the launcher stays
torch-free): `asyncrl.utils.tiny_model` builds the random-init model, `python -m reverse_text` writes
the SFT data, `sft` trains with a weight dir every `interval` steps, and `asyncrl.bench.heldout
--validation --first-reaching` finds (by bisection) the first whose sampled accuracy reaches
`target_accuracy` (else the last): that one becomes the model.

Invariants: `model/` and `warmup.json` appear only once complete (`transport.files`: temp name, then
rename; `warmup.json` is written last), so an interrupted warm-up is redone, never half-reused. The SFT
scratch (checkpoints, the other weight dirs) is removed once the model is chosen.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loguru import logger

from asyncrl.config import bench as job
from asyncrl.core.errors import UserError
from asyncrl.transport.files import publish_dir, write_text_atomic

RECORD = "warmup.json"
SFT_THREADS = "2"


@dataclass
class WarmModel:
    path: Path
    info: dict[str, Any]  # what warmup.json records: chosen SFT step, accuracies, seconds
    cached: bool


def cached(root: Path) -> WarmModel | None:
    record = root / RECORD
    if not record.exists() or not (root / "model" / "config.json").exists():
        return None
    return WarmModel(root / "model", json.loads(record.read_text()), cached=True)


def ensure_warm_model(root: Path, spec: dict[str, Any] | None = None) -> WarmModel:
    """The warmed model under `root`: reused when present, else built, SFT-trained and chosen."""
    found = cached(root)
    if found is not None:
        logger.info(f"bench: reusing the warmed model {found.path} (warm-up skipped)")
        return found
    spec = {**job.WARMUP, **(spec or {})}
    start = time.monotonic()
    root.mkdir(parents=True, exist_ok=True)
    logger.info(f"bench: building and SFT-warming the tiny model in {root} (once; later runs reuse it)")
    _build(root / "base")
    _sft_data(root / "sft.jsonl", spec["sft_examples"])
    _sft(root, spec)
    step, scores = _choose(root / "sft" / "weights", spec["target_accuracy"], root / "sft" / "choose.log")
    _publish_model(root / "sft" / "weights" / f"step_{step}", root / "model")
    info = {"key": job.warm_key(), "sft_step": step, "validation": scores, "seconds": time.monotonic() - start}
    info["spec"] = spec
    shutil.rmtree(root / "sft" / "checkpoints", ignore_errors=True)
    shutil.rmtree(root / "sft" / "weights", ignore_errors=True)
    write_text_atomic(root / RECORD, json.dumps(info, indent=1))
    return WarmModel(root / "model", info, cached=False)


def _run(cmd: list[str], log: Path, what: str, env: dict[str, str] | None = None) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}).returncode
    if code != 0:
        tail = "\n".join(log.read_text().splitlines()[-15:])
        raise UserError(f"bench warm-up: {what} failed (exit code {code}); end of {log}:\n{tail}")


def _build(out: Path) -> None:
    m = job.MODEL
    args = ["--hidden-size", m["hidden_size"], "--num-layers", m["num_layers"], "--num-heads", m["num_heads"]]
    args += ["--num-kv-heads", m["num_kv_heads"], "--intermediate-size", m["intermediate_size"], "--seed", m["seed"]]
    cmd = [sys.executable, "-m", "asyncrl.utils.tiny_model", str(out), *map(str, args)]
    _run(cmd, out.parent / "logs" / "tiny_model.log", "building the tiny model")


def _sft_data(out: Path, n: int) -> None:
    cmd = [sys.executable, "-m", "reverse_text", "--sft-out", str(out), "--n", str(n)]
    cmd += ["--seed", str(job.ENV_SEED), "--min-len", str(job.MIN_LEN), "--max-len", str(job.MAX_LEN)]
    cmd += ["--system-prompt", job.SYSTEM_PROMPT, "--user-template", job.USER_TEMPLATE]
    _run(cmd, out.parent / "logs" / "sft_data.log", "writing the SFT data (is the reverse-text env installed?)")


def sft_toml(root: Path, spec: dict[str, Any]) -> str:
    """The `sft` config of the warm-up."""
    return "\n".join(
        [
            f"max_steps = {spec['max_steps']}",
            f'output_dir = "{root / "sft"}"',
            f'[model]\nname = "{root / "base"}"',
            f'[data]\nname = "{root / "sft.jsonl"}"\nseq_len = {spec["seq_len"]}',
            f"batch_size = {spec['batch_size']}\nmicro_batch_size = {spec['batch_size']}",
            f"[optim]\nlr = {spec['lr']}\nweight_decay = 0.0",
            # no retention: keep_last would prune the weight dirs `_choose` bisects over (a tiny model: a few MB each;
            # the SFT scratch is removed once the model is chosen)
            f"[ckpt]\ninterval = {spec['interval']}",
            "",
        ]
    )


def _sft(root: Path, spec: dict[str, Any]) -> None:
    config = root / "sft.toml"
    config.write_text(sft_toml(root, spec))
    logger.info(f"bench: SFT warm-up, {spec['max_steps']} steps at most (log: {root / 'logs' / 'sft.log'})")
    cmd = [sys.executable, "-m", "asyncrl.entrypoints.sft", "@", str(config)]
    # the loss drops sharply at a step that moves with the float reduction order: pin the threads
    _run(cmd, root / "logs" / "sft.log", "sft", env={"OMP_NUM_THREADS": SFT_THREADS})


def _choose(weights: Path, target: float, log: Path) -> tuple[int, list[dict]]:
    """The first weight step whose validation sampled accuracy reaches `target` (else the last), by bisection."""
    from asyncrl.transport.layout import step_dirs

    dirs = [str(d) for d in step_dirs(weights).values()]
    cmd = [sys.executable, "-m", "asyncrl.bench.heldout", "--validation", "--first-reaching", str(target), *dirs]
    with open(log, "w") as err:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines or "chosen" not in lines[-1]:
        raise UserError(f"bench warm-up: scoring the SFT weights failed; see {log}")
    scores = [{"step": _step(r.pop("model")), **r} for r in lines[:-1]]
    for s in sorted(scores, key=lambda r: r["step"]):
        accuracy = f"{s['sampled']:.3f} (T=1), {s['greedy']:.3f} (greedy)"
        logger.info(f"bench: SFT step {s['step']}: validation exact match {accuracy}")
    return _step(lines[-1]["chosen"]), scores


def _step(model_dir: str) -> int:
    return int(Path(model_dir).name.removeprefix("step_"))


def _publish_model(src: Path, dest: Path) -> None:
    publish_dir(dest, lambda tmp: shutil.copytree(src, tmp, dirs_exist_ok=True))
