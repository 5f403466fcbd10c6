"""Trainer checkpoints: DCP shards of model + optimizer, JSON progress, a STABLE marker.

Contents of `checkpoints/step_N/trainer` (`transport.layout` places it; `step_N` = the state after N
optimizer steps, resume runs step N)::

    .metadata, __*_*.distcp     torch.distributed.checkpoint (sharded)
    progress.json               step, tokens, samples, scheduler, world size
    STABLE                      written last: the checkpoint is complete

Retention (keep_last / keep_interval) and the resume-step rule are the layout's (`transport.layout`),
shared with the orchestrator and the `rl` launcher; retention applies to the exported `weights/step_N` too
(never those of a step with a complete checkpoint), after each save.
A dir without the marker is partial (a save that died) and is never loaded. Async saves stage a CPU
copy of the state synchronously and write it in a background thread on a separate gloo group, so the
next optimizer step cannot race them; the marker and retention happen once the write has finished.
"""

from __future__ import annotations

import json
import shutil
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from loguru import logger
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from asyncrl.config.base import CkptConfig
from asyncrl.core import failpoint
from asyncrl.core.errors import UserError, raise_if_full
from asyncrl.transport.files import mark_stable
from asyncrl.transport.layout import TRAINER, RunLayout

PROGRESS = "progress.json"


def complete_steps(layout: RunLayout) -> list[int]:
    """Steps with a complete (STABLE) trainer checkpoint, ascending."""
    return layout.complete_checkpoints(TRAINER)


class CheckpointManager:
    """Saves (sync or async) and loads trainer checkpoints. Every method is collective over all ranks."""

    def __init__(self, layout: RunLayout, cfg: CkptConfig, rank: int, only: dict[str, str] | None = None) -> None:
        self.layout = layout
        self.cfg = cfg
        self.rank = rank
        # a multi-run trainer's run: the parameters of its adapter slot, by the slot-free names its checkpoint
        # stores them under (it may resume in another slot); None: the whole model
        self.only = only
        self._group = dist.new_group(backend="gloo")  # async writes must not share the training group
        self._pending: tuple[Future, int, dict[str, Any]] | None = None

    def due(self, step: int, final: bool) -> bool:
        return final or step % self.cfg.interval == 0

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict[str, Any]) -> None:
        """Checkpoint the state after `step` steps; `extra` (JSON-able progress, scheduler) goes to progress.json."""
        self.wait()
        path = self.layout.checkpoint_dir(step, TRAINER)
        if self.rank == 0 and path.exists():
            shutil.rmtree(path)
        dist.barrier(group=self._group)
        state = self._state(model, optimizer)
        if self.cfg.save_async:
            future = dcp.async_save(state, checkpoint_id=str(path), process_group=self._group)
            self._pending = (future, step, extra)
            logger.debug(f"checkpoint step_{step}: staged, writing in the background")
        else:
            try:
                dcp.save(state, checkpoint_id=str(path), process_group=self._group)
            except BaseException as e:  # DCP's CheckpointException is a BaseException
                raise_if_full(path.parent, e)
                raise
            self._finish(step, extra)

    def wait(self) -> None:
        """Block until a pending async save is on disk, then mark it complete."""
        if self._pending is None:
            return
        future, step, extra = self._pending
        self._pending = None
        try:
            future.result()
        except BaseException as e:
            raise_if_full(self.layout.checkpoint_dir(step, TRAINER), e)
            raise
        self._finish(step, extra)

    def _finish(self, step: int, extra: dict[str, Any]) -> None:
        failpoint.reached("trainer.checkpoint", step)
        dist.barrier(group=self._group)  # every rank's shards are written
        if self.rank == 0:
            path = self.layout.checkpoint_dir(step, TRAINER)
            (path / PROGRESS).write_text(json.dumps(extra, indent=1))
            mark_stable(path)
            logger.info(f"saved checkpoint {path}")
            self._apply_retention(step)
        dist.barrier(group=self._group)

    def _apply_retention(self, step: int) -> None:
        """keep_last / keep_interval: trainer checkpoints, then the exported weights of the steps they dropped."""
        deleted = self.layout.prune_checkpoints(TRAINER, self.cfg.keep_last, self.cfg.keep_interval)
        if deleted:
            logger.debug(f"deleted trainer checkpoints {deleted} (retention)")
        weights = self.layout.prune_weights(step, self.cfg.keep_last, self.cfg.keep_interval)
        if weights:
            logger.debug(f"deleted weights {weights} (retention)")

    def load(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Restore model + optimizer in place from step `step`; returns its progress.json."""
        path = self.layout.checkpoint_dir(step, TRAINER)
        state = self._state(model, optimizer)
        try:
            dcp.load(state, checkpoint_id=str(path), process_group=self._group)
            extra = json.loads((path / PROGRESS).read_text())
        except CheckpointException as e:  # per-rank failures; name the first underlying error
            rank, (inner, _) = next(iter(e.failures.items()))
            raise UserError(
                f"checkpoint {path} is corrupted and cannot be loaded (rank {rank}: "
                f"{type(inner).__name__}: {inner}); resume from another step"
            ) from None
        except (OSError, ValueError, RuntimeError) as e:
            raise UserError(f"checkpoint {path} is corrupted and cannot be loaded ({type(e).__name__}: {e})") from e
        model_sd, optim_sd = state["model"], state["optim"]
        if self.only is not None:
            back = {stored: name for name, stored in self.only.items()}
            model_sd, optim_sd = _renamed(model_sd, optim_sd, back)
        options = StateDictOptions(strict=self.only is None)
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=options)
        return extra

    def _state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        if self.only is not None:
            model_sd, optim_sd = _renamed({k: v for k, v in model_sd.items() if k in self.only}, optim_sd, self.only)
        return {"model": model_sd, "optim": optim_sd}

    def close(self) -> None:
        self.wait()
        dist.destroy_process_group(self._group)


def _renamed(model_sd: dict, optim_sd: dict, names: dict[str, str]) -> tuple[dict, dict]:
    """Model and (FQN-keyed) optimizer state dicts with their parameter names mapped through `names`."""
    groups = [{**g, "params": [names[p] for p in g["params"]]} for g in optim_sd["param_groups"]]
    optim = {"state": {names[k]: v for k, v in optim_sd["state"].items()}, "param_groups": groups}
    return {names[k]: v for k, v in model_sd.items()}, optim
