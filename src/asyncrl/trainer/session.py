"""One training run around a loop: everything the RL and SFT trainers share besides their batches and losses.

`run_training(config, layout, loop_cls)` joins the process group, lets the loop check its data, loads the
model (FSDP2), builds AdamW and the schedule, resumes from a checkpoint, then runs `train_step`
until `max_steps` or the loop's data ends, logging every step. A `Loop` (`trainer.rl`, `trainer.sft`)
only builds each step's micro-batches and runs forward/backward on one of them; the session owns
the optimizer step, progress, metrics, checkpoints, weight export and `--bench`.

Invariants:
- Loss normalisation: each micro-batch's summed token loss is scaled by dp_size / (loss-mask
  tokens of the whole step over all ranks), since FSDP2 averages gradients over the data-parallel ranks
  (world / model.tp; the ranks of one tp row share a batch); the gradient is the per-token mean over the
  step, whatever the packing, micro-batch size, sharding or tp.
- Step n (0-based) is logged as step n and leaves the state `step_{n+1}` (weights, checkpoints).
- A checkpoint holds model + optimizer (DCP) and progress.json: progress, the loop's data position,
  scheduler, world size; resuming from it continues exactly. Every step reseeds torch from (seed,
  step, rank), so dropout replays identically after a resume.
- A non-finite loss or gradient norm stops the run before the optimizer step: no weights for it.
- A step with no loss tokens on any rank (every loss mask False) is a no-op, with a warning naming the step
  and its batch: no forward/backward and no optimizer step (weights and optimizer state unchanged), but it
  counts: progress and the schedule advance and its outputs (weights `step_{n+1}`, checkpoints) are written,
  so step numbers and the orchestrator's wait for weights stay as always. Every rank decides alike: the
  count is summed over ranks.
"""

from __future__ import annotations

import math
import time
import warnings
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from loguru import logger

from asyncrl.config.sft import SFTConfig
from asyncrl.config.trainer import TrainerConfig
from asyncrl.core.errors import UserError
from asyncrl.trainer.ckpt import CheckpointManager
from asyncrl.trainer.dist import DistContext, init_distributed, peer_lost
from asyncrl.trainer.export import export_adapter, export_weights
from asyncrl.trainer.model import LoadedModel, load_model
from asyncrl.trainer.moe import RouterLoad
from asyncrl.trainer.optim import apply_gradients, build_optimizer, build_scheduler
from asyncrl.trainer.perf import FlopModel, mfu, peak_flops, peak_memory_gib, reset_peak_memory, throughput_summary
from asyncrl.transport.layout import RunLayout, resolve_resume_step
from asyncrl.utils.monitor import MetricsSink
from asyncrl.utils.progress import Bar

THROUGHPUT_STEPS = 5  # --bench without --max-steps: one warm-up step + four timed ones

TrainConfig = TrainerConfig | SFTConfig


@dataclass
class AdapterSlot:
    """One adapter slot of a multi-run trainer's model: what a run's session trains and exports."""

    lm: LoadedModel
    index: int
    params: list[tuple[str, torch.nn.Parameter, str]]  # (state-dict name, parameter, PEFT key)


@dataclass
class StepBatch:
    """One step's micro-batches on this rank, with the step's totals over all ranks."""

    micro_batches: list[Any]
    loss_tokens: int  # the loss normaliser
    tokens: int
    samples: int
    flops: float
    info: dict[str, Any] = field(default_factory=dict)  # the loop's metrics, logged after `samples`
    timing: dict[str, float] = field(default_factory=dict)  # time spent on data, logged after `step_time_s`


class Loop:
    """The part of a trainer that knows its data and loss. `__init__` runs before the model loads."""

    metrics_name: str  # metrics/<name>.jsonl

    def __init__(self, session: TrainSession) -> None:
        self.session = session

    def start(self) -> None:
        """The model is loaded: build the data source (it may need the vocabulary or the pad token)."""

    def planned_steps(self) -> int | None:
        """Steps the learning-rate schedule decays over."""
        return self.session.max_steps

    def next_batch(self, step: int, together: bool = False) -> StepBatch | None:
        """Step `step`'s input, or None when the data has ended. `together` (multi-run): its micro_batches are
        the step's rows, unplanned, for `forward_backward_together`."""
        raise NotImplementedError

    @classmethod
    def forward_backward_together(cls, loops: list[Loop], batches: list[StepBatch]) -> list[dict[str, torch.Tensor]]:
        """Multi-run: forward/backward of one step of each of several runs (`loops`, sharing one model) in shared
        forward passes; each run's token sums on this rank, as `forward_backward_step`'s."""
        raise NotImplementedError(f"{cls.__name__} trains one run at a time")

    def forward_backward_step(self, micro_batch: Any, scale: float) -> dict[str, torch.Tensor]:
        """Forward, backward of loss * scale; returns detached token sums, `loss` among them."""
        raise NotImplementedError

    def exhausted(self) -> bool:
        """No data is left after the step just run."""
        return False

    def end_step(self, step: int, final: bool) -> dict[str, float]:
        """Outputs once `step` steps are done (weights, a due checkpoint); returns metrics about them."""
        raise NotImplementedError

    def data_state(self) -> dict[str, Any]:
        """What a checkpoint stores besides model, optimizer, scheduler and progress."""
        return {}

    def restore(self, step: int, extra: dict[str, Any]) -> None:
        """The session resumed at `step` from a checkpoint whose progress.json is `extra`."""

    def bad_loss_hint(self, step: int) -> str:
        """Appended to the error of a non-finite loss at `step`."""
        raise NotImplementedError

    def batch_name(self, step: int) -> str:
        """Where step `step`'s data came from, for warnings about it."""
        return f"step {step}'s batch"

    def step_summary(self) -> dict[str, float]:
        """Metrics of the step just run that are not token sums (quantiles, maxima); called after backward."""
        return {}

    def take_distributions(self) -> dict[str, list[torch.Tensor]]:
        """Per-token values of the step just run, for W&B histograms (empty unless they were due)."""
        return {}

    def log_line(self, step: int, m: dict) -> str:
        raise NotImplementedError

    def throughput_header(self) -> str:
        raise NotImplementedError

    def finish(self, history: list[dict], step: int) -> None:
        """After the last step (`step` steps done) and the final checkpoint."""


def run_training(config: TrainConfig, layout: RunLayout, loop_cls: type[Loop]) -> list[dict]:
    """Train until `max_steps` or the end of the data; returns every step's metrics (on every rank). `layout`:
    the run's (the process's, made once by its entrypoint)."""
    return in_process_group(config, lambda ctx: TrainSession(config, layout, ctx, loop_cls).run())


def in_process_group(config: TrainConfig, body: Callable[[DistContext], Any]) -> Any:
    """`body(ctx)` in a joined process group; a rank that went away is one clear line, not a traceback."""
    ctx = init_distributed(config.device, config.model.tp, config.model.ep)
    try:
        result = body(ctx)
        ctx.barrier()  # no rank tears its sockets down while another still reads its last collective
        return result
    except Exception as e:
        if (lost := peer_lost(e)) is None:
            raise
        raise UserError(
            f"trainer rank {ctx.rank} lost contact with another rank ({lost}): a trainer process or node died or "
            f"its network went down; its own log under {config.output_dir}/logs/ says why (trainer_rank<R>.log)"
        ) from None
    finally:
        ctx.close()


class TrainSession:
    """Process group, model, optimizer, schedule, checkpoints, metrics and progress of one run."""

    def __init__(
        self,
        config: TrainConfig,
        layout: RunLayout,
        ctx: DistContext,
        loop_cls: type[Loop],
        slot: AdapterSlot | None = None,
    ) -> None:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        self.config, self.ctx, self.slot = config, ctx, slot
        self.out = Path(config.output_dir)
        self.layout = layout
        self.max_steps = config.max_steps if config.max_steps or not config.bench else THROUGHPUT_STEPS
        self.loop = loop_cls(self)
        self.resume_step = self._resume_step()  # a bad one fails before the (slow) model load
        if slot is None:
            self._load_model()
        else:
            self._use_model(slot.lm, [p for _, p, _ in slot.params])
        self.loop.start()
        self.optimizer = build_optimizer(self.params, config.optim)
        self.scheduler = build_scheduler(self.optimizer, config.scheduler, self.loop.planned_steps())
        only = {name: key for name, _, key in slot.params} if slot is not None else None
        self.ckpt = CheckpointManager(self.layout, config.ckpt, ctx.rank, only) if self._checkpoints else None
        self.progress = {"step": 0, "tokens": 0, "samples": 0}
        self.sink = MetricsSink(
            self.layout, self.loop.metrics_name, config.wandb, config.model_dump(mode="json"), ctx.is_main
        )

    @property
    def _checkpoints(self) -> bool:
        return self.config.ckpt is not None and not self.config.bench

    def _resume_step(self) -> int | None:
        requested = self.config.ckpt.resume_step if self._checkpoints else None
        return resolve_resume_step(self.layout, requested, self.max_steps) if requested is not None else None

    def _load_model(self) -> None:
        torch.manual_seed(self.config.seed)
        lm = load_model(self.config.model, self.config.tokenizer.name, self.ctx.mesh)
        self._use_model(lm, [p for p in lm.model.parameters() if p.requires_grad])

    def _use_model(self, lm: LoadedModel, params: list[torch.nn.Parameter]) -> None:
        self.lm, self.model, self.params = lm, lm.model, params
        self.router_load = RouterLoad(lm.model)  # MoE: tokens per expert (no hooks on a dense model)
        self.flops = FlopModel.from_hf_config(self.lm.hf_config, self.lm.matmul_params)
        self.peak = peak_flops(self.ctx.device)

    @property
    def vocab_size(self) -> int:
        return self.model.get_input_embeddings().weight.shape[0]

    # ---- one step ----------------------------------------------------------------------------------

    def train_step(self, step: int) -> dict | None:
        """Forward/backward every micro-batch of step `step`, clip, step; its metrics (None: data ended)."""
        batch = self.open_step(step)
        if batch is None:
            return None
        start = time.perf_counter()
        if batch.loss_tokens == 0:  # the same on every rank: summed over ranks
            return self.empty_step(step, batch, start)
        return self.finish_step(step, batch, self._forward_backward(batch), start)

    def open_step(self, step: int, together: bool = False) -> StepBatch | None:
        """Step `step`'s input (None: the data has ended); `together`: its rows, for `forward_backward_together`."""
        torch.manual_seed(self.config.seed + 1_000_003 * step + self.ctx.dp_rank)  # resume-exact dropout (LoRA)
        batch = self.loop.next_batch(step, together) if together else self.loop.next_batch(step)
        reset_peak_memory(self.ctx.device)
        return batch

    def finish_step(self, step: int, batch: StepBatch, sums: dict[str, torch.Tensor], start: float) -> dict:
        """Step `step` after its forward/backward (`sums`: this rank's token sums): check, clip, step; its metrics."""
        losses = self._reduce(sums, batch.loss_tokens)
        if not math.isfinite(losses["loss"]):
            raise UserError(
                f"loss is {losses['loss']} at step {step}; stopped before the optimizer step"
                + self.loop.bad_loss_hint(step)
            )
        grad_norm, lr = apply_gradients(self.params, self.optimizer, self.scheduler, self.config.optim.max_norm, step)
        seconds = time.perf_counter() - start
        self._advance(step, batch)
        return self._step_metrics(batch, losses, grad_norm, lr, seconds)

    def empty_step(self, step: int, batch: StepBatch, start: float) -> dict:
        """A step without loss tokens on any rank: warned about, then counted without training (see the module
        docstring). Its loss and grad_norm are 0, `empty_step` is 1, and the loop's token metrics are absent."""
        if self.ctx.is_main:
            logger.warning(
                f"step {step}: {self.loop.batch_name(step)} has no loss tokens on any rank (every loss_mask is "
                f"False): skipped as a no-op, weights step_{step + 1} = step_{step}'s; if this repeats, the samples "
                "have no completion tokens (check the orchestrator's filters and sampling.max_tokens)"
            )
        lr = self.scheduler.get_last_lr()[0]
        with warnings.catch_warnings():  # torch's warning about a schedule stepped before any optimizer step
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step", category=UserWarning)
            self.scheduler.step()
        self._advance(step, batch)
        losses = {"loss": 0.0, "empty_step": 1.0}  # no entropy or KL: a 0 there would read as a collapse
        return self._step_metrics(batch, losses, 0.0, lr, time.perf_counter() - start)

    def _forward_backward(self, batch: StepBatch) -> dict[str, torch.Tensor]:
        """This rank's token sums over every micro-batch."""
        scale = self.loss_scale(batch)
        sums: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros((), device=self.ctx.device))
        for mb in batch.micro_batches:
            for key, value in self.loop.forward_backward_step(mb, scale).items():
                sums[key] += value
        return sums

    def loss_scale(self, batch: StepBatch) -> float:
        """What a micro-batch's summed token loss is scaled by: dp_size / the step's loss tokens on all ranks
        (FSDP2 averages gradients over the data-parallel ranks), so the gradient is the per-token mean over the step."""
        return self.ctx.dp_size / max(batch.loss_tokens, 1)

    def _reduce(self, sums: dict[str, torch.Tensor], loss_tokens: int) -> dict[str, float]:
        """Token sums summed over ranks, per loss-mask token of the step."""
        denom, keys = max(loss_tokens, 1), sorted(sums)
        totals = self.ctx.all_reduce_sum(torch.stack([sums[k] for k in keys]))
        return {k: float(v) / denom for k, v in zip(keys, totals)}

    def _advance(self, step: int, batch: StepBatch) -> None:
        self.progress = {
            "step": step + 1,
            "tokens": self.progress["tokens"] + batch.tokens,
            "samples": self.progress["samples"] + batch.samples,
        }

    def _step_metrics(self, batch: StepBatch, losses: dict, grad_norm: float, lr: float, seconds: float) -> dict:
        return {
            **losses,
            "grad_norm": grad_norm,
            "lr": lr,
            "tokens": batch.tokens,
            "loss_tokens": batch.loss_tokens,
            "samples": batch.samples,
            **batch.info,
            **self.loop.step_summary(),
            "step_time_s": seconds,
            **batch.timing,
            "tokens_per_s": batch.tokens / seconds,
            "mfu": mfu(batch.flops, seconds, self.peak, self.ctx.world_size),
            "peak_mem_gib": peak_memory_gib(self.ctx.device),
            **self.router_load.take(self.ctx.all_reduce_sum),
        }

    # ---- outputs -----------------------------------------------------------------------------------

    def checkpoint_due(self, step: int, final: bool) -> bool:
        return self.ckpt is not None and self.ckpt.due(step, final)

    def save_checkpoint(self, step: int) -> None:
        """Collective: the state after `step` steps to `checkpoints/step_{step}/trainer`."""
        extra = {
            "progress": self.progress,
            **self.loop.data_state(),
            "scheduler": self.scheduler.state_dict(),
            "world_size": self.ctx.world_size,
        }
        self.ckpt.save(step, self.model, self.optimizer, extra)

    def export(self, dests: list[Path]) -> None:
        """Collective: the current weights as a HF dir at every path in `dests` (rank 0 writes, STABLE last);
        with LoRA, the adapter alone too, in PEFT format, in each dir's `adapter/`; a run of a multi-run
        trainer (`slot`), its adapter alone."""
        lm, lora = self.lm, self.config.model.lora
        generation_config = getattr(self.model, "generation_config", None)
        adapter = None
        if lora is not None:
            adapter = {"rank": lora.rank, "alpha": lora.alpha, "dropout": lora.dropout}
            adapter["base_model"] = self.config.model.name
        if self.slot is not None:
            tensors = [(key, p) for _, p, key in self.slot.params]
            export_adapter(tensors, dests, adapter, lm.export_dtype, self.ctx.is_main)
            return
        export_weights(
            self.model,
            dests,
            lm.hf_config,
            lm.tokenizer,
            lm.export_dtype,
            lm.lora_scale,
            self.ctx.is_main,
            generation_config,
            adapter,
        )

    def _log(self, step: int, m: dict) -> None:
        if self.ctx.is_main:
            logger.info(self.loop.log_line(step, m))
            self.sink.log(step, m)
            if dists := self.loop.take_distributions():
                self.sink.histograms(step, {k: torch.cat(v).tolist() for k, v in dists.items()})

    # ---- the run -----------------------------------------------------------------------------------

    def _resume(self) -> int:
        if self.resume_step is None:
            return 0
        step = self.resume_step
        extra = self.ckpt.load(step, self.model, self.optimizer)
        self.scheduler.load_state_dict(extra["scheduler"])
        self.progress = extra["progress"]
        self.loop.restore(step, extra)
        return step

    def begin(self) -> int:
        """Resume if asked; the first step to run (its metrics rows and later ones are dropped: redone)."""
        step = self._resume()
        self.sink.restart_at(step)
        return step

    def run_step(self, step: int) -> dict | None:
        """Train step `step`, write its outputs and log it; its metrics (None: the data had ended)."""
        metrics = self.train_step(step)
        return None if metrics is None else self.publish_step(step, metrics)

    def publish_step(self, step: int, metrics: dict) -> dict:
        """Step `step` is trained: write its outputs (weights, a due checkpoint) and log `metrics`."""
        if not self.config.bench:
            metrics.update(self.loop.end_step(step + 1, self.is_final(step + 1)))
        self._log(step, metrics)
        return metrics

    def is_final(self, done: int) -> bool:
        """Whether the run ends once `done` steps are done."""
        return done == self.max_steps or self.loop.exhausted()

    def run(self) -> list[dict]:
        step = self.begin()
        history: list[dict] = []
        with Bar(self.loop.metrics_name, self.loop.planned_steps(), step, enabled=self.ctx.is_main) as bar:
            while self.max_steps is None or step < self.max_steps:
                metrics = self.run_step(step)
                if metrics is None:
                    break
                step += 1
                bar.update(step, loss=metrics.get("loss"), **{"tok/s": metrics.get("tokens_per_s")})
                history.append(metrics)
                if self.is_final(step):
                    break
        self.close(history, step)
        return history

    def close(self, history: list[dict], step: int) -> None:
        if self.ckpt is not None:
            self.ckpt.close()
        self.sink.close()
        self.loop.finish(history, step)
        if self.config.bench and self.ctx.is_main:
            print_throughput(self.loop.throughput_header(), history)


def print_throughput(header: str, history: list[dict]) -> None:
    print(header)
    print(throughput_summary(history))
