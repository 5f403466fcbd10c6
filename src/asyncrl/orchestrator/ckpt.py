"""Orchestrator checkpoints: run progress and the rollout buffer, beside the trainer's checkpoint.

    checkpoints/step_{N}/orchestrator/progress.json   step N, totals, prompt-sampling position
    checkpoints/step_{N}/orchestrator/buffer.json     finished groups not yet used in a batch

Checkpoint step_N is the state after N steps (batches 0..N-1 written); a run resumes at step N.
The dir is written under a temporary name and renamed into place.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from loguru import logger

from asyncrl.config.base import CkptConfig
from asyncrl.orchestrator.filtering import Group
from asyncrl.orchestrator.samples import Rollout, TokenSample
from asyncrl.transport.files import publish_dir
from asyncrl.transport.weights import step_dirs
from asyncrl.utils.errors import UserError

COMPONENT = "orchestrator"


@dataclass
class Progress:
    step: int = 0
    total_tokens: int = 0
    total_samples: int = 0
    total_problems: int = 0
    sampler: dict = field(default_factory=dict)


def checkpoints_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def ckpt_dir(output_dir: str | Path, step: int) -> Path:
    return checkpoints_root(output_dir) / f"step_{step}" / COMPONENT


def save(output_dir: str | Path, progress: Progress, buffer: list[Group]) -> Path:
    def write(tmp: Path) -> None:
        (tmp / "progress.json").write_text(json.dumps(asdict(progress), indent=1))
        (tmp / "buffer.json").write_text(json.dumps([asdict(g) for g in buffer]))

    return publish_dir(ckpt_dir(output_dir, progress.step), write, marker=False)


def _group_from_dict(d: dict) -> Group:
    rollouts = []
    for r in d["rollouts"]:
        samples = [TokenSample(**s) for s in r.pop("samples")]
        rollouts.append(Rollout(**r, samples=samples))
    return Group(
        env=d["env"], example_id=d["example_id"], policy_step=d["policy_step"], rollouts=rollouts, verdict=d["verdict"]
    )


def load(output_dir: str | Path, step: int) -> tuple[Progress, list[Group]]:
    path = ckpt_dir(output_dir, step)
    if not (path / "progress.json").exists():
        raise UserError(f"no orchestrator checkpoint at {path}; check --ckpt.resume-step and the output dir")
    progress = Progress(**json.loads((path / "progress.json").read_text()))
    if progress.step != step:
        raise UserError(f"orchestrator checkpoint {path} says step {progress.step}, expected {step}")
    buffer_file = path / "buffer.json"
    buffer = [_group_from_dict(d) for d in json.loads(buffer_file.read_text())] if buffer_file.exists() else []
    return progress, buffer


def saved_steps(output_dir: str | Path) -> list[int]:
    return [s for s, d in step_dirs(checkpoints_root(output_dir)).items() if (d / COMPONENT / "progress.json").exists()]


def resolve_resume_step(output_dir: str | Path, resume_step: int) -> int:
    """`resume_step`, with -1 meaning the latest orchestrator checkpoint."""
    if resume_step >= 0:
        return resume_step
    steps = saved_steps(output_dir)
    if not steps:
        raise UserError(
            f"--ckpt.resume-step -1 (latest) but no orchestrator checkpoint under {checkpoints_root(output_dir)}"
        )
    return max(steps)


def prune(output_dir: str | Path, config: CkptConfig) -> list[int]:
    """Apply keep_last / keep_interval to the orchestrator's part of the checkpoints."""
    if config.keep_last is None:
        return []
    steps = sorted(saved_steps(output_dir))
    keep = set(steps[-config.keep_last :])
    if config.keep_interval:
        keep |= {s for s in steps if s % config.keep_interval == 0}
    removed = []
    for s in steps:
        if s in keep:
            continue
        path = ckpt_dir(output_dir, s)
        shutil.rmtree(path, ignore_errors=True)
        try:
            path.parent.rmdir()  # only if the trainer's part is gone too
        except OSError:
            pass
        removed.append(s)
    if removed:
        logger.debug(f"pruned orchestrator checkpoints {removed}")
    return removed
