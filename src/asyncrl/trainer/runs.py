"""Multi-run training: one trainer, one frozen base model, up to `max_concurrent_runs` LoRA runs at once.

A run is `{output_dir}/run_NAME/`, itself an ordinary run dir: an ordinary orchestrator writes its batches
there and serves its adapter under the model name NAME. It appears when `run_NAME/run.toml` (its
`config.trainer.RunConfig`) does. The trainer then gives it a free adapter slot (all slots are allocated
with the model: FSDP2 takes no parameters after sharding) and a `TrainSession` of its own: AdamW over the
slot, schedule, loss, progress, checkpoints under `run_NAME/checkpoints`, metrics, W&B run and the log
`run_NAME/logs/trainer.log`. Each round trains one step of every run whose next batch is there, all of them in
shared forward passes (`Loop.forward_backward_together`: rows of several runs in one batch, each row through its
own run's adapter, each run's loss and optimizer its own); a run whose batch is ready waits up to
`company_wait` round times for the others' so that they train together. A run's policies are its adapter alone
(`broadcast/step_N/adapter`, PEFT format).

A run ends when its last step is done, when `run_NAME/STOP` appears, or when it fails (a batch it cannot
read, a non-finite loss or gradient, a bad run.toml or resume step): its slot is freed, `run_status.json`
says how it ended (a run with that file is not admitted again until it is removed), and the other runs go
on. The trainer ends once every run named in `runs` has ended (unset: it serves runs until stopped).

Invariants: rank 0 decides each round (which runs stop, start, train) and broadcasts it, so every rank runs
the same collectives in the same order; a failure is decided on every rank alike (losses are all-reduced,
a batch that one rank cannot read is agreed on before any forward). A run resumes only from its own
checkpoints; a fresh run's slot is re-initialised from its seed, so a reused slot carries nothing over.
This is a frame beside `session` (single-run's), not a loop: `rl.loop.train` branches here with `max_concurrent_runs`
and passes its `RLLoop` in; nothing here imports a loop.
"""

from __future__ import annotations

import json
import math
import time
import tomllib
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
from loguru import logger
from torch.distributed.tensor import DTensor, distribute_tensor

from asyncrl.config import loader
from asyncrl.config.trainer import RunConfig, TrainerConfig
from asyncrl.core.errors import UserError
from asyncrl.trainer.dist import DistContext
from asyncrl.trainer.model import load_model
from asyncrl.trainer.session import AdapterSlot, Loop, StepBatch, TrainSession, in_process_group
from asyncrl.transport.files import write_text_atomic
from asyncrl.transport.layout import RUN_NAME, RUN_NAME_RULE, RunLayout

POLL_S = 0.05  # rank 0 looks for new batches, runs and STOP files this often
ROUND_S = 1.0  # ... and tells the other ranks at least this often that there is nothing to do
DONE, FAILED, STOPPED = "done", "failed", "stopped"


@dataclass
class Run:
    name: str
    slot: int
    session: TrainSession
    step: int  # the next step to train
    log_sink: int | None  # the loguru handler of run_NAME/logs/trainer.log (rank 0)
    history: list[dict] = field(default_factory=list)


@dataclass
class Plan:
    """What every rank does this round, in this order (rank 0 decides)."""

    stop: dict[str, str] = field(default_factory=dict)  # run -> why (the STOP file says it, or nothing)
    admit: list[tuple[str, dict | str]] = field(default_factory=list)  # run.toml's contents, or why it is unreadable
    train: list[str] = field(default_factory=list)
    exit: bool = False

    def __bool__(self) -> bool:
        return bool(self.stop or self.admit or self.train or self.exit)


def _stop_reason(stop: Path) -> str:
    """What a run's STOP file says (rl writes why, e.g. its orchestrator died), or that it was asked to end."""
    try:
        said = stop.read_text().strip()
    except OSError:
        said = ""
    return said or f"{stop} asked it to end"


def run_trainer_config(base: TrainerConfig, layout: RunLayout, name: str, raw: dict) -> TrainerConfig:
    """The trainer settings of run `name`: the trainer's own, overridden by its run.toml (`raw`)."""
    if not RUN_NAME.match(name):
        raise UserError(f"run name {name!r} is not usable as a model name: use {RUN_NAME_RULE}")
    try:
        loader.validate(RunConfig, raw)
    except UserError as e:
        raise UserError(f"{layout.run_dir(name) / 'run.toml'}: {e}") from None
    merged = loader.deep_merge(
        base.model_dump(mode="json", exclude={"max_concurrent_runs", "runs", "company_wait"}), raw
    )
    merged["output_dir"] = str(layout.run_dir(name))
    if base.wandb is not None:
        merged["wandb"]["name"] = f"{base.wandb.name or 'trainer'}-{name}"
        if base.wandb.id:  # one W&B run per run, not all resuming into one
            merged["wandb"]["id"] = f"{base.wandb.id}-{name}"
    return TrainerConfig.model_validate(merged)


def read_run_config(layout: RunLayout, name: str) -> dict | str:
    """Run `name`'s run.toml as a dict, or the one-line reason it cannot be read."""
    path = layout.run_dir(name) / "run.toml"
    try:
        return tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        return f"{path} is not readable TOML ({e})"


def reset_slot(slot: AdapterSlot, seed: int) -> None:
    """A fresh adapter in place: every A random (kaiming, from `seed`, alike on every rank), every B zeros."""
    g = torch.Generator().manual_seed(seed)
    for name, p, _ in slot.params:
        full = torch.zeros(p.shape, dtype=p.dtype)
        if ".lora_A." in name:
            bound = 1 / math.sqrt(p.shape[1])  # what kaiming_uniform_(a=sqrt(5)) draws for a [rank, in] weight
            full.uniform_(-bound, bound, generator=g)
        with torch.no_grad():
            if isinstance(p, DTensor):  # this rank's shard (on the mesh's device; CPU offload keeps it on CPU)
                mesh = p.device_mesh
                p.to_local().copy_(distribute_tensor(full.to(mesh.device_type), mesh, p.placements).to_local())
            else:
                p.copy_(full)


def _name_the_run(record) -> None:
    """loguru patcher: a run's lines say which run they are about."""
    if (name := record["extra"].get("run")) is not None:
        record["message"] = f"[{name}] {record['message']}"


def train_runs(config: TrainerConfig, layout: RunLayout, loop_cls: type[Loop]) -> dict[str, list[dict]]:
    """Serve the runs under `config.output_dir` until every run of `config.runs` has ended, each run's steps
    being `loop_cls`'s (the RL loop passes itself in: this frame never imports a loop)."""
    return in_process_group(config, lambda ctx: MultiRunTrainer(config, layout, ctx, loop_cls).run())


class MultiRunTrainer:
    def __init__(self, config: TrainerConfig, layout: RunLayout, ctx: DistContext, loop_cls: type[Loop]) -> None:
        self.config, self.layout, self.ctx, self.loop_cls = config, layout, ctx, loop_cls
        torch.manual_seed(config.seed)
        self.lm = load_model(config.model, config.tokenizer.name, ctx.mesh, slots=config.max_concurrent_runs)
        by_name = {n.replace("_checkpoint_wrapped_module.", ""): p for n, p in self.lm.model.named_parameters()}
        self.slots = [
            AdapterSlot(self.lm, i, [(n, by_name[n], key) for n, key in names.items()])
            for i, names in enumerate(self.lm.slot_names)
        ]
        self.free = list(range(len(self.slots)))
        self.runs: dict[str, Run] = {}
        self.results: dict[str, list[dict]] = {}
        self.round_s = 0.0  # the last round: forwards, backwards, each run's optimizer step and outputs
        self.ready_since: dict[str, float] = {}  # rank 0: since when a run's next batch has been there
        logger.configure(patcher=_name_the_run)
        if ctx.is_main:
            wanted = f"runs {', '.join(config.runs)}" if config.runs else "runs as they appear"
            logger.info(f"multi-run trainer: {len(self.slots)} adapter slots; {wanted} under {self.layout.root}/run_*")

    # ---- rank 0: what to do ------------------------------------------------------------------------

    def _plan(self) -> Plan:
        """Rank 0: wait (up to ROUND_S) for something to do, then say it."""
        deadline = time.monotonic() + ROUND_S
        while not (plan := self._look()) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        return plan

    def _look(self) -> Plan:
        plan, layout = Plan(), self.layout
        stops = {n: r.session.layout.run_stop for n, r in self.runs.items()}
        plan.stop = {n: _stop_reason(path) for n, path in stops.items() if path.exists()}
        free = len(self.free) + len(plan.stop)
        for name in layout.run_names():
            if free == 0:
                break
            if name not in self.runs and not layout.run(name).run_status.exists():
                plan.admit.append((name, read_run_config(layout, name)))
                free -= 1
        ready = [n for n, r in self.runs.items() if n not in plan.stop and r.session.layout.batch_dir(r.step).exists()]
        plan.train = self._with_company(ready, plan.stop)
        if not plan and self.config.runs is not None and not self.runs:
            plan.exit = all(layout.run(n).run_status.exists() for n in self.config.runs)
        return plan

    def _with_company(self, ready: list[str], stopping: dict[str, str]) -> list[str]:
        """The ready runs to train now: all of them once no other run is still waiting for its batch, or once
        the longest-ready has waited `company_wait` times the last round's duration for the others."""
        now = time.monotonic()
        for name in ready:
            self.ready_since.setdefault(name, now)
        others = [n for n in self.runs if n not in ready and n not in stopping]
        waited = now - min((self.ready_since[n] for n in ready), default=now)
        if ready and others and waited < self.config.company_wait * self.round_s:
            return []
        for name in ready:
            del self.ready_since[name]
        return ready

    # ---- every rank: doing it ----------------------------------------------------------------------

    def run(self) -> dict[str, list[dict]]:
        """Serve runs until every run of `runs` has ended; every run's step metrics, by name."""
        while True:
            plan = self.ctx.broadcast(self._plan() if self.ctx.is_main else None)
            if plan.exit:
                break
            for name, why in plan.stop.items():
                self._end(self.runs[name], STOPPED, why)
            for name, raw in plan.admit:
                self._admit(name, raw)
            if ready := [self.runs[n] for n in plan.train if n in self.runs]:
                self._train(ready)
        if self.ctx.is_main:
            logger.info(f"every run has ended: {', '.join(sorted(self.results)) or 'none'}")
        return self.results

    def _admit(self, name: str, raw: dict | str) -> None:
        slot = self.free.pop(0)
        sink = None
        if self.ctx.is_main:
            path = self.layout.run(name).log_file("trainer")
            sink = logger.add(path, level=self.config.log.level.upper(), filter=lambda r: r["extra"].get("run") == name)
        with logger.contextualize(run=name):
            session = None
            try:
                if isinstance(raw, str):
                    raise UserError(raw)
                cfg = run_trainer_config(self.config, self.layout, name, raw)
                reset_slot(self.slots[slot], cfg.seed * 1_000_003 + zlib.crc32(name.encode()))
                own = RunLayout.for_config(cfg)  # the run's own dir and checkpoints
                session = TrainSession(cfg, own, self.ctx, self.loop_cls, slot=self.slots[slot])
                run = Run(name, slot, session, session.begin(), sink)
            except UserError as e:  # e.g. a checkpoint it cannot resume from: the run fails, not the trainer
                if session is not None:
                    session.close([], 0)
                self.free.insert(0, slot)
                self._record(name, FAILED, 0, str(e), sink)
                return
            logger.info(f"run {name} started in adapter slot {slot} at step {run.step} (max_steps {cfg.max_steps})")
        self.runs[name] = run

    def _train(self, runs: list[Run]) -> None:
        """One step of each of `runs`, their rows in shared forward passes (`Loop.forward_backward_together`)."""
        opened: list[tuple[Run, StepBatch]] = []
        for run in runs:
            with logger.contextualize(run=run.name):
                try:
                    batch = run.session.open_step(run.step, together=True)
                except UserError as e:  # an unreadable batch: the run fails before any forward, the others go on
                    self._end(run, FAILED, str(e))
                    continue
            if batch is None:
                self._end(run, DONE)
            elif batch.loss_tokens == 0:  # a no-op step (session.empty_step), alike on every rank
                with logger.contextualize(run=run.name):
                    self._stepped(run, run.session.empty_step(run.step, batch, time.perf_counter()))
            else:
                opened.append((run, batch))
        if not opened:
            return
        start = time.perf_counter()
        sums = self.loop_cls.forward_backward_together([r.session.loop for r, _ in opened], [b for _, b in opened])
        for (run, batch), run_sums in zip(opened, sums):
            with logger.contextualize(run=run.name):
                try:
                    metrics = run.session.finish_step(run.step, batch, run_sums, start)
                except UserError as e:  # a non-finite loss or gradient: this run's alone (its slot's gradients)
                    run.session.optimizer.zero_grad(set_to_none=True)
                    self._end(run, FAILED, str(e))
                    continue
                metrics["runs_together"] = len(opened)
                self._stepped(run, metrics)
        self.round_s = time.perf_counter() - start

    def _stepped(self, run: Run, metrics: dict) -> None:
        """Run `run` trained its step (`metrics`): its outputs and log, then the next step or its end."""
        try:
            run.history.append(run.session.publish_step(run.step, metrics))
        except UserError as e:
            self._end(run, FAILED, str(e))
            return
        run.step += 1
        if run.session.is_final(run.step):
            self._end(run, DONE)

    def _end(self, run: Run, state: str, error: str | None = None) -> None:
        with logger.contextualize(run=run.name):
            run.session.close(run.history, run.step)
        del self.runs[run.name]
        self.ready_since.pop(run.name, None)
        self.free.append(run.slot)
        self.results[run.name] = run.history
        self._record(run.name, state, run.step, error, run.log_sink)

    def _record(self, name: str, state: str, step: int, error: str | None, sink: int | None) -> None:
        """Rank 0: say how run `name` ended, in the log and in its run_status.json."""
        if not self.ctx.is_main:
            return
        with logger.contextualize(run=name):
            said = f"run {name} {state} after step {step}" + (f": {error}" if error else "")
            (logger.error if state == FAILED else logger.info)(said)
        status = {"state": state, "step": step, "error": error, "time": time.time()}
        write_text_atomic(self.layout.run(name).run_status, json.dumps(status))
        if sink is not None:
            logger.remove(sink)
