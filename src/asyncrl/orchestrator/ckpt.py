"""Orchestrator checkpoints: run progress and the rollout buffer, beside the trainer's checkpoint.

Contents of `checkpoints/step_{N}/orchestrator` (`transport.layout` places it and applies retention)::

    progress.json   step N, totals, prompt-sampling position
    buffer.json     finished groups not yet used in a batch

Checkpoint step_N is the state after N steps (batches 0..N-1 written); a run resumes at step N.
The dir is written under a temporary name and renamed into place. `load` checks what it reads (JSON, the
fields' types): a damaged file is a UserError naming it, never a traceback later in the run.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from loguru import logger

from asyncrl.config.base import CkptConfig
from asyncrl.core import failpoint
from asyncrl.core.errors import UserError
from asyncrl.orchestrator.filtering import Group
from asyncrl.orchestrator.samples import Rollout, TokenSample
from asyncrl.transport.files import publish_dir
from asyncrl.transport.layout import ORCHESTRATOR, TRAINER, RunLayout

COMPONENT = ORCHESTRATOR
PROGRESS = "progress.json"


@dataclass
class Progress:
    step: int = 0
    total_tokens: int = 0
    total_samples: int = 0
    total_problems: int = 0
    sampler: dict = field(default_factory=dict)

    def advance(self, step: int, tokens: int, samples: int, problems: int, sampler: dict) -> None:
        """Step `step`'s batch is written: the run is `step + 1` steps in, with these totals and sampler."""
        self.step = step + 1
        self.total_tokens += tokens
        self.total_samples += samples
        self.total_problems += problems
        self.sampler = sampler


def _complete(path: Path) -> bool:
    return (path / PROGRESS).exists()


def save(layout: RunLayout, progress: Progress, buffer: list[Group]) -> Path:
    def write(tmp: Path) -> None:
        (tmp / PROGRESS).write_text(json.dumps(asdict(progress), indent=1))
        failpoint.reached("orchestrator.checkpoint", progress.step)
        (tmp / "buffer.json").write_text(json.dumps([asdict(g) for g in buffer]))

    return publish_dir(layout.checkpoint_dir(progress.step, COMPONENT), write, marker=False)


def _group_from_dict(d: dict) -> Group:
    rollouts = []
    for r in d["rollouts"]:
        samples = [TokenSample(**s) for s in r.pop("samples")]
        rollouts.append(Rollout(**r, samples=samples))
    return Group(
        env=d["env"], example_id=d["example_id"], policy_step=d["policy_step"], rollouts=rollouts, verdict=d["verdict"]
    )


def _progress(raw: object) -> Progress:
    """progress.json's content as a Progress; TypeError naming the file and field where a type is wrong."""
    if not isinstance(raw, dict):
        raise TypeError(f"{PROGRESS} holds a {type(raw).__name__}, not an object")
    progress = Progress(**raw)  # an unknown field: TypeError
    for f in fields(Progress):
        value, kind = getattr(progress, f.name), dict if f.name == "sampler" else int
        if not isinstance(value, kind) or isinstance(value, bool) or (kind is int and value < 0):
            wanted = "an object" if kind is dict else "an integer >= 0"
            raise TypeError(f"{PROGRESS}: {f.name} is {value!r}, expected {wanted}")
    return progress


def load(layout: RunLayout, step: int) -> tuple[Progress, list[Group]]:
    path = layout.checkpoint_dir(step, COMPONENT)
    if not _complete(path):
        raise UserError(f"no orchestrator checkpoint at {path}; check --ckpt.resume-step and the output dir")
    buffer_file = path / "buffer.json"
    try:
        progress = _progress(json.loads((path / PROGRESS).read_text()))
        buffer = [_group_from_dict(d) for d in json.loads(buffer_file.read_text())] if buffer_file.exists() else []
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise UserError(
            f"orchestrator checkpoint {path} is corrupted ({type(e).__name__}: {e}); resume from another step"
        ) from None
    if progress.step != step:
        raise UserError(f"orchestrator checkpoint {path} says step {progress.step}, expected {step}")
    return progress, buffer


def saved_steps(layout: RunLayout) -> list[int]:
    return layout.complete_checkpoints(COMPONENT, _complete)


def resolve_resume_step(layout: RunLayout, resume_step: int) -> int:
    """`resume_step`; -1: the step the trainer resumes at too (its latest with both checkpoints), or where this
    output dir has no trainer checkpoint (an orchestrator run alone), the latest orchestrator checkpoint."""
    if resume_step >= 0:
        return resume_step
    steps = layout.resumable_steps() if layout.complete_checkpoints(TRAINER) else saved_steps(layout)
    if not steps:
        raise UserError(f"--ckpt.resume-step -1 (latest) but no orchestrator checkpoint under {layout.checkpoints}")
    return max(steps)


def prune(layout: RunLayout, config: CkptConfig) -> list[int]:
    """Apply keep_last / keep_interval to the orchestrator's part of the checkpoints, sparing the steps from the
    trainer's latest complete one on: running ahead, the orchestrator must not delete the step a resume needs."""
    trainer = layout.complete_checkpoints(TRAINER)
    keep_from = trainer[-1] if trainer else (0 if layout.trainer_world.exists() else None)  # None: no trainer here
    removed = layout.prune_checkpoints(COMPONENT, config.keep_last, config.keep_interval, _complete, keep_from)
    if removed:
        logger.debug(f"pruned orchestrator checkpoints {removed}")
    return removed
