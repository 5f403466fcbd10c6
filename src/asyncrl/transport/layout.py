"""The run directory: every path, `step_N` dir and marker under one run's output dir, and their clean-up.

On disk (under `output_dir`)::

    rollouts/step_{n}/rank_{r}.pt, meta.json    step n's batch, orchestrator -> trainer (see transport.batch)
    broadcast/step_{n}/                         HF dir (safetensors, config, tokenizer), trainer -> server
    broadcast/step_{n}/STABLE                   empty marker: the dir is complete
    weights/step_{n}/ (+ STABLE)                same HF format, kept at checkpoint steps and at the end
                                                (ckpt.keep_last / keep_interval prune them as checkpoints)
    {broadcast,weights}/step_{n}/adapter/       a LoRA run's adapter alone (PEFT format) in each of those dirs
    checkpoints/step_{n}/trainer/               DCP shards, progress.json, STABLE (written last)
    checkpoints/step_{n}/orchestrator/          progress.json, buffer.json
                                                (a run resumes at a step with a complete trainer checkpoint;
                                                `ckpt.path` moves checkpoints/ elsewhere)
    logs/<component>.log, <component>.stdout    each process's log; what the launcher caught of its output
    logs/<component>.pid                        the process's pid, host, start; exit code and error at its end
    metrics/<component>.jsonl                   one JSON row per step
    configs/<component>.toml                    the resolved config the launcher gave each process
    trainer_world.json                          {"world_size": N}, trainer rank 0 at start: the orchestrator packs
                                                for N ranks (`trainer_world_size`)
    run_{name}/                                 multi-run: one LoRA run, itself a run dir of this layout, plus
    run_{name}/run.toml, STOP, run_status.json    its trainer settings (appearing: the run starts), a request
                                                to end it, the trainer's word on how it ended

Steps are 0-based: `step_{n}` holds the policy after n updates ("ckpt n"; step 0 is the base model and
is never written). Trainer step n consumes `rollouts/step_{n}` and publishes `broadcast/step_{n+1}`;
rollouts of step n come from a policy >= n-k (k = max_async_level). A run with max_steps = N runs steps
0..N-1 and ends with `weights/step_{N}`; checkpoint `step_{N}` resumes at step N.

Invariants: a name matches `step_{n}` exactly or is not a step dir (temporary dirs are `.tmp_*`).
`STABLE` is written only by `transport.files.mark_stable` (after the rename of an atomic publish, or once
every rank's checkpoint shards are written) and read only by `is_stable`; a dir without it may be partial.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from loguru import logger

from asyncrl.core.errors import UserError

STABLE = "STABLE"
TRAINER = "trainer"  # the trainer's checkpoint component: complete once it has its STABLE marker
ADAPTER = "adapter"  # a LoRA run's PEFT adapter, inside each exported weight dir
ORCHESTRATOR = "orchestrator"  # the orchestrator's: complete once it exists (it is renamed into place whole)
_STEP_DIR = re.compile(r"^step_(\d+)$")
RUN_PREFIX = "run_"
RUN_NAME = re.compile(r"^(?!.*\.\.)[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")  # a served adapter name too: the server's rule
RUN_NAME_RULE = "up to 64 letters, digits, '_', '.', '-', starting with a letter or digit, without '..'"


def step_of(name: str) -> int | None:
    """n for a `step_{n}` name, else None."""
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def step_dirs(root: str | Path) -> dict[int, Path]:
    """`step_N` subdirs of `root` by step, ascending (temp dirs and other names are ignored)."""
    root = Path(root)
    if not root.is_dir():
        return {}
    found = {step_of(d.name): d for d in root.iterdir() if d.is_dir()}
    return {s: found[s] for s in sorted(s for s in found if s is not None)}


def is_stable(path: str | Path) -> bool:
    """Whether `path` carries the STABLE marker, i.e. was completely written."""
    return (Path(path) / STABLE).exists()


def steps_to_delete(steps: Iterable[int], keep_last: int | None, keep_interval: int | None) -> list[int]:
    """Retention: keep the newest `keep_last` (all if None) plus multiples of `keep_interval`."""
    if keep_last is None:
        return []
    steps = sorted(steps)
    newest = set(steps[-keep_last:])
    return [s for s in steps if s not in newest and not (keep_interval and s % keep_interval == 0)]


def run_dir(output_dir: str | Path, name: str) -> Path:
    """Multi-run: where run `name` of the runs under `output_dir` lives (`run_{name}/`)."""
    return Path(output_dir) / f"{RUN_PREFIX}{name}"


class RunLayout:
    """The paths of one run; every method that deletes only ever touches `step_N` dirs. A process makes its
    run's layout once (`for_config`) and passes it down; a multi-run run's is `layout.run(name)`."""

    def __init__(self, output_dir: str | Path, checkpoints: str | Path = "checkpoints"):
        self.root = Path(output_dir)
        self._checkpoints = checkpoints  # as given: a run's own dir resolves it the same way (see `run`)
        self.rollouts = self.root / "rollouts"
        self.broadcast = self.root / "broadcast"
        self.weights = self.root / "weights"
        self.checkpoints = self.root / checkpoints  # `ckpt.path`: relative to the output dir, or absolute
        self.logs = self.root / "logs"
        self.metrics = self.root / "metrics"
        self.configs = self.root / "configs"
        self.samples = self.root / "samples.jsonl"  # each step's best and worst rollout, for the run report
        self.trainer_world = self.root / "trainer_world.json"  # trainer rank 0 at start: {"world_size": N}
        self.run_config = self.root / "run.toml"  # multi-run: this run's trainer settings (config.trainer.RunConfig)
        self.run_stop = self.root / "STOP"  # multi-run: anyone may ask the trainer to end this run
        self.run_status = self.root / "run_status.json"  # multi-run: {"state": done|failed|stopped, "step", "error"}

    @classmethod
    def for_config(cls, config: Any) -> RunLayout:
        """The layout of the run a component's config writes to: its `output_dir` and, if it has one, its
        `ckpt.path` (made once per process and passed down; rl's is its trainer's: `for_config(cfg.trainer)`)."""
        ckpt = getattr(config, "ckpt", None)
        return cls(config.output_dir, ckpt.path if ckpt else "checkpoints")

    def run(self, name: str) -> RunLayout:
        """Multi-run: run `name`'s layout (`run_{name}/`, itself a run dir; a relative `ckpt.path` is under it)."""
        return RunLayout(self.run_dir(name), self._checkpoints)

    def run_dir(self, name: str) -> Path:
        return run_dir(self.root, name)

    def run_names(self) -> list[str]:
        """Names of the `run_{name}` dirs whose run.toml exists (a run appears once its settings do), sorted."""
        if not self.root.is_dir():
            return []
        dirs = (d for d in self.root.iterdir() if d.name.startswith(RUN_PREFIX) and (d / "run.toml").is_file())
        return sorted(d.name.removeprefix(RUN_PREFIX) for d in dirs)

    def log_file(self, component: str, suffix: str = ".log") -> Path:
        return self.logs / f"{component}{suffix}"

    def pid_file(self, component: str) -> Path:
        return self.logs / f"{component}.pid"

    def metrics_file(self, name: str) -> Path:
        return self.metrics / f"{name}.jsonl"

    def batch_dir(self, step: int) -> Path:
        return self.rollouts / f"step_{step}"

    def broadcast_dir(self, step: int) -> Path:
        return self.broadcast / f"step_{step}"

    def weights_dir(self, step: int) -> Path:
        return self.weights / f"step_{step}"

    def adapter_dir(self, step: int) -> Path:
        """A LoRA run's adapter of step `step`, in PEFT format (inside the kept weights)."""
        return self.weights_dir(step) / ADAPTER

    def checkpoint_dir(self, step: int, component: str) -> Path:
        return self.checkpoints / f"step_{step}" / component

    def checkpoints_of(self, component: str) -> dict[int, Path]:
        """`component`'s checkpoint dirs by step, complete or not."""
        return {s: d / component for s, d in step_dirs(self.checkpoints).items() if (d / component).is_dir()}

    def complete_checkpoints(self, component: str, complete: Callable[[Path], bool] = is_stable) -> list[int]:
        """Steps whose `component` checkpoint is complete by `complete(dir)`, ascending."""
        return [s for s, d in self.checkpoints_of(component).items() if complete(d)]

    def resumable_steps(self) -> list[int]:
        """Steps a run can resume at, ascending: a complete trainer checkpoint and, on a run that has orchestrator
        checkpoints, the orchestrator's of the same step (a process killed mid-save leaves one without the other)."""
        trainer, orchestrator = self.complete_checkpoints(TRAINER), self.checkpoints_of(ORCHESTRATOR)
        return [s for s in trainer if s in orchestrator] if orchestrator else trainer

    def prune_checkpoints(
        self,
        component: str,
        keep_last: int | None,
        keep_interval: int | None,
        complete: Callable[[Path], bool] = is_stable,
        keep_from: int | None = None,
    ) -> list[int]:
        """Apply retention to `component`'s complete checkpoints, never to steps >= `keep_from`;
        `step_N` itself goes with its last part."""
        kept = steps_to_delete(self.complete_checkpoints(component, complete), keep_last, keep_interval)
        doomed = [s for s in kept if keep_from is None or s < keep_from]
        for step in doomed:
            path = self.checkpoint_dir(step, component)
            shutil.rmtree(path, ignore_errors=True)
            with contextlib.suppress(OSError):
                path.parent.rmdir()  # only once the other component has nothing there either
        return doomed

    def prune_weights(self, upto: int, keep_last: int | None, keep_interval: int | None) -> list[int]:
        """Apply checkpoint retention to the exported weights `weights/step_N` of steps <= `upto` (the step just
        checkpointed; later ones may be an earlier, longer run's): keep the newest `keep_last` plus multiples of
        `keep_interval`, and always the weights of a step with a complete trainer checkpoint (a resume there
        serves them)."""
        steps = [s for s in step_dirs(self.weights) if s <= upto]
        resumable = set(self.complete_checkpoints(TRAINER))
        doomed = [s for s in steps_to_delete(steps, keep_last, keep_interval) if s not in resumable]
        for step in doomed:
            shutil.rmtree(self.weights_dir(step), ignore_errors=True)
        return doomed

    def prune_batches(self, keep_from_step: int) -> list[Path]:
        """Delete batches of steps < keep_from_step (the trainer has consumed them)."""
        return _remove_steps(self.rollouts, lambda s: s < keep_from_step)

    def prune_broadcast(self, keep_from_step: int, keep: set[int] = frozenset()) -> list[Path]:
        """Delete broadcast dirs of steps < keep_from_step except those in `keep`."""
        return _remove_steps(self.broadcast, lambda s: s < keep_from_step and s not in keep)

    def remove_leftovers(self) -> list[Path]:
        """Temporary dirs (`.tmp_*`) of publishes a killed process never finished; only while no process runs."""
        roots = [self.rollouts, self.broadcast, self.weights, *step_dirs(self.checkpoints).values()]
        left = [p for root in roots if root.is_dir() for p in root.iterdir() if p.name.startswith(".tmp_")]
        for path in left:
            shutil.rmtree(path, ignore_errors=True)
        if left:
            logger.info(f"removed {len(left)} half-written dirs an earlier run left: {[p.name for p in left]}")
        return left

    def clear_stale(self, start: int) -> list[Path]:
        """Before a run (re)starts at step `start`: delete batches >= start and broadcast weights > start
        that an earlier attempt left, so neither process can mistake them for this attempt's."""
        stale = _remove_steps(self.rollouts, lambda s: s >= start) + _remove_steps(self.broadcast, lambda s: s > start)
        if stale:
            logger.warning(
                f"removed {len(stale)} rollout/broadcast dirs past step {start} left by an earlier run: "
                f"{sorted(str(p.relative_to(self.root)) for p in stale)}"
            )
        return stale


def trainer_world_size(layout: RunLayout) -> int | None:
    """The rank count trainer rank 0 wrote to `trainer_world.json` (None while there is none); a UserError naming
    the file when it is not {"world_size": N >= 1} (the trainer writes it atomically: only a hand-made one is)."""
    path = layout.trainer_world
    if not path.exists():
        return None
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        problem = f"{type(e).__name__}: {e}"
    else:
        ranks = raw.get("world_size") if isinstance(raw, dict) else None
        if isinstance(ranks, int) and not isinstance(ranks, bool) and ranks >= 1:
            return ranks
        problem = f"world_size is {ranks!r}" if isinstance(raw, dict) else f"it holds a {type(raw).__name__}"
    raise UserError(
        f'{path} is malformed ({problem}), expected {{"world_size": N}} with N >= 1: delete it (trainer rank 0 '
        "writes it again at start) or set the orchestrator's num_train_workers"
    )


def _remove_steps(root: Path, doomed: Callable[[int], bool]) -> list[Path]:
    removed = [path for step, path in step_dirs(root).items() if doomed(step)]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def resolve_resume_step(layout: RunLayout, requested: int, max_steps: int | None = None) -> int:
    """-1 -> the latest complete checkpoint; N -> N if complete. Clear errors otherwise, including a
    checkpoint at or past `max_steps` (nothing would be left to train)."""
    step = _find_resume_step(layout, requested)
    if max_steps is not None and step >= max_steps:
        raise UserError(f"resuming at step {step} but max_steps is {max_steps}: nothing to train; raise --max-steps")
    return step


def _find_resume_step(layout: RunLayout, requested: int) -> int:
    root, complete, all_dirs = layout.checkpoints, layout.resumable_steps(), layout.checkpoints_of(TRAINER)
    trainer_only = [s for s in layout.complete_checkpoints(TRAINER) if s not in complete]  # no orchestrator part
    if requested == -1:
        if not complete:
            lacking = f"; trainer checkpoints {trainer_only} lack the orchestrator's part" if trainer_only else ""
            raise UserError(
                f"ckpt.resume_step = -1 but no checkpoint under {root} is complete (the trainer's and, on a run with "
                f"an orchestrator, the orchestrator's of the same step){lacking}"
            )
        partial = [s for s in all_dirs if s > complete[-1]]
        if partial:
            logger.warning(f"skipping partial checkpoints (a save that did not finish) at steps {partial}")
        return complete[-1]
    if requested in complete:
        return requested
    if requested in trainer_only:
        raise UserError(
            f"no orchestrator checkpoint at {layout.checkpoint_dir(requested, ORCHESTRATOR)} (the trainer's "
            f"step_{requested} is complete; the orchestrator's save of that step did not happen or was deleted); "
            f"resume from one of {complete or 'none'}"
        )
    if requested in all_dirs:
        raise UserError(
            f"checkpoint {all_dirs[requested]} is partial or corrupted (no {STABLE} marker: its save did not "
            f"finish); resume from one of {complete or 'none'} or delete it"
        )
    raise UserError(f"no trainer checkpoint for step {requested} under {root}; available steps: {complete or 'none'}")
