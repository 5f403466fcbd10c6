"""The RL training loop: `train(config)` turns packed rollout batches into new policy weights, step by step.

Step n (0-based): wait for `rollouts/step_n`, run every micro-batch of this rank forward/backward,
clip, optimizer step, publish `broadcast/step_{n+1}` (HF dir, STABLE last), prune old broadcast dirs
outside the async window, checkpoint when due, log metrics.

Loss normalisation: each micro-batch's summed token loss is divided by the number of loss-mask
tokens of the whole step (all micro-batches on all ranks, counted with one all-reduce before the
first forward) and multiplied by the world size, because FSDP2 averages gradients over ranks. The
gradient is therefore the per-token mean over the step, independent of packing and sharding.

Runs in one plain process (a 1-rank gloo/NCCL group is made on the fly) or under torchrun.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from pathlib import Path

import torch
from loguru import logger

from asyncrl.config.base import BenchDataConfig
from asyncrl.config.trainer import TrainerConfig
from asyncrl.trainer.ckpt import CheckpointManager, complete_steps, resolve_resume_step
from asyncrl.trainer.dist import DistContext, init_distributed
from asyncrl.trainer.export import export_weights
from asyncrl.trainer.loss import LossInputs, get_loss_fn, mismatch_kl_sum, token_entropy, token_logprobs
from asyncrl.trainer.model import LoadedModel, load_model
from asyncrl.trainer.optim import apply_gradients, build_optimizer, build_scheduler
from asyncrl.trainer.perf import (
    FlopModel,
    bench_summary,
    format_mfu,
    mfu,
    peak_flops,
    peak_memory_gib,
    reset_peak_memory,
)
from asyncrl.trainer.rl.data import FakeSource, PackedRow, RolloutSource, prepare
from asyncrl.transport.batch import prune_batches
from asyncrl.transport.weights import broadcast_dir, prune_broadcast, weights_dir
from asyncrl.utils.errors import UserError
from asyncrl.utils.monitor import MetricsSink

BENCH_STEPS = 5  # --bench without --max-steps: one warmup step + four timed ones


def train(config: TrainerConfig) -> list[dict]:
    """Train until `max_steps` (or forever); returns the metrics of every step run (on every rank)."""
    ctx = init_distributed(config.device)
    try:
        return _Trainer(config, ctx).run()
    finally:
        ctx.close()


class _Trainer:
    def __init__(self, config: TrainerConfig, ctx: DistContext) -> None:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        self.config, self.ctx = config, ctx
        self.out = Path(config.output_dir)
        torch.manual_seed(config.seed)
        self.max_steps = config.max_steps if config.max_steps or not config.bench else BENCH_STEPS
        resume = config.ckpt.resume_step if config.ckpt and not config.bench else None
        # a bad resume step fails before the (slow) model load
        self.resume_step = resolve_resume_step(self.out, resume, self.max_steps) if resume is not None else None
        self.lm: LoadedModel = load_model(config.model, config.tokenizer.name, ctx.mesh)
        self.model = self.lm.model
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.model, config.optim)
        self.scheduler = build_scheduler(self.optimizer, config.scheduler, self.max_steps)
        self.loss_fn = get_loss_fn(config.loss)
        self.flops = FlopModel.from_hf_config(self.lm.hf_config, self.lm.matmul_params)
        self.peak = peak_flops(ctx.device)
        self.ckpt = CheckpointManager(self.out, config.ckpt, ctx.rank) if config.ckpt and not config.bench else None
        self.progress = {"step": 0, "tokens": 0, "samples": 0}
        if config.bench or config.data.fake is not None:
            shape = config.data.fake or BenchDataConfig()
            self.source = FakeSource(
                shape, self.model.get_input_embeddings().weight.shape[0], ctx.rank, ctx.world_size, config.seed
            )
        else:
            self.source = RolloutSource(self.out, ctx.rank, ctx.world_size, config.recv_timeout)
        self.sink = MetricsSink(self.out, "trainer", config.wandb, config.model_dump(mode="json"), ctx.is_main)

    # ---- setup -------------------------------------------------------------------------------------

    def _resume(self) -> int:
        if self.resume_step is None:
            return 0
        step = self.resume_step
        extra = self.ckpt.load(step, self.model, self.optimizer)
        self.scheduler.load_state_dict(extra["scheduler"])
        self.progress = extra["progress"]
        if extra.get("world_size") != self.ctx.world_size:
            logger.warning(
                f"checkpoint was written by {extra.get('world_size')} ranks, resuming on {self.ctx.world_size}"
            )
        logger.info(f"resumed from checkpoint step_{step} ({self.progress['tokens']:,} tokens so far)")
        # the orchestrator resuming at this step waits for these weights; re-publish them if pruned
        if not (broadcast_dir(self.out, step) / "STABLE").exists():
            self._publish(step, keep_weights=False)
        return step

    # ---- one step ----------------------------------------------------------------------------------

    def _forward_backward(self, rows: list[PackedRow], denom: float) -> dict[str, torch.Tensor]:
        sums: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros((), device=self.ctx.device))
        scale = self.ctx.world_size / denom
        for row in rows:
            logits = self.model(
                input_ids=row.input_ids[None], position_ids=row.position_ids[None], use_cache=False
            ).logits[0]
            logprobs = token_logprobs(logits, row.input_ids, row.temperatures)
            inputs = LossInputs(
                logprobs, row.inference_logprobs, row.advantages, row.loss_mask, row.sample_ids, row.num_samples
            )
            out = self.loss_fn(inputs, self.config.loss)
            (out.loss * scale).backward()
            sums["loss"] += out.loss.detach().float()
            sums["entropy"] += (token_entropy(logits.detach(), row.temperatures) * row.loss_mask).sum()
            sums["mismatch_kl"] += mismatch_kl_sum(inputs)
            for key, value in out.metrics.items():
                sums[key] += value.detach().float()
            del logits, logprobs, out
        return sums

    def _step(self, step: int) -> dict:
        ctx = self.ctx
        torch.manual_seed(self.config.seed + 1_000_003 * step + ctx.rank)  # resume-exact dropout (LoRA)
        start = time.perf_counter()
        rows = [prepare(mb, ctx.device) for mb in self.source.get(step)]
        wait_s = time.perf_counter() - start

        counts = torch.tensor(
            [
                sum(int(r.loss_mask.sum()) for r in rows),
                sum(r.input_ids.numel() for r in rows),
                sum(int(torch.bincount(r.sample_ids[r.loss_mask], minlength=r.num_samples).gt(0).sum()) for r in rows),
                sum(self.flops.row_flops(r.sample_lengths) for r in rows),
            ],
            dtype=torch.float64,
        )
        loss_tokens, tokens, samples, flops = ctx.all_reduce_sum(counts).tolist()
        denom = max(loss_tokens, 1.0)

        reset_peak_memory(ctx.device)
        compute_start = time.perf_counter()
        sums = self._forward_backward(rows, denom)
        keys = sorted(sums)
        totals = ctx.all_reduce_sum(torch.stack([sums[k] for k in keys]))
        metrics = {k: float(v) / denom for k, v in zip(keys, totals)}
        if not math.isfinite(metrics["loss"]):
            raise UserError(
                f"loss is {metrics['loss']} at step {step}; stopped before the optimizer step, no weights written for "
                f"step {step + 1} (lower optim.lr, or check the rollout batch rollouts/step_{step})"
            )
        grad_norm, lr = apply_gradients(self.params, self.optimizer, self.scheduler, self.config.optim.max_norm, step)
        compute_s = time.perf_counter() - compute_start

        self.progress = {
            "step": step + 1,
            "tokens": self.progress["tokens"] + int(tokens),
            "samples": self.progress["samples"] + int(samples),
        }
        metrics.update(
            grad_norm=grad_norm,
            lr=lr,
            tokens=int(tokens),
            loss_tokens=int(loss_tokens),
            samples=int(samples),
            step_time_s=compute_s,
            wait_s=wait_s,
            tokens_per_s=tokens / compute_s,
            mfu=mfu(flops, compute_s, self.peak, ctx.world_size),
            peak_mem_gib=peak_memory_gib(ctx.device),
        )
        return metrics

    # ---- outputs -----------------------------------------------------------------------------------

    def _publish(self, step: int, keep_weights: bool) -> None:
        dests = [broadcast_dir(self.out, step)] + ([weights_dir(self.out, step)] if keep_weights else [])
        export_weights(
            self.model,
            dests,
            self.lm.hf_config,
            self.lm.tokenizer,
            self.lm.export_dtype,
            self.lm.lora_scale,
            self.ctx.is_main,
            getattr(self.model, "generation_config", None),
        )

    def _prune(self, step: int) -> None:
        """Rank 0: drop broadcast dirs outside the async window (except around kept checkpoints), consumed batches."""
        k = self.config.max_async_level
        keep = {s for c in complete_steps(self.out) for s in range(c - k, c + 1)} if self.ckpt else set()
        prune_broadcast(self.out, keep_from_step=step - k, keep=keep)
        prune_batches(self.out, keep_from_step=step - 1)

    def _log(self, step: int, m: dict) -> None:
        if not self.ctx.is_main:
            return
        logger.info(
            f"step {step} | loss {m['loss']:.4f} | entropy {m['entropy']:.3f} | mismatch_kl {m['mismatch_kl']:.2e} | "
            f"masked {m.get('masked_frac', 0):.1%} | grad_norm {m['grad_norm']:.3f} | lr {m['lr']:.2e} | "
            f"{m['step_time_s']:.2f}s {m['tokens_per_s']:,.0f} tok/s | mfu {format_mfu(m['mfu'])} | "
            f"mem {m['peak_mem_gib']:.2f} GiB | wait {m['wait_s']:.2f}s"
        )
        self.sink.log(step, m)

    def run(self) -> list[dict]:
        step = self._resume()
        history = []
        while self.max_steps is None or step < self.max_steps:
            metrics = self._step(step)
            step += 1
            final = step == self.max_steps
            ckpt_due = self.ckpt is not None and self.ckpt.due(step, final)
            if not self.config.bench:
                publish_start = time.perf_counter()
                self._publish(step, keep_weights=ckpt_due or final)
                if ckpt_due:
                    self.ckpt.save(
                        step,
                        self.model,
                        self.optimizer,
                        {
                            "progress": self.progress,
                            "scheduler": self.scheduler.state_dict(),
                            "world_size": self.ctx.world_size,
                        },
                    )
                if self.ctx.is_main:
                    self._prune(step)
                metrics["publish_s"] = time.perf_counter() - publish_start
            self._log(step - 1, metrics)
            history.append(metrics)
        if self.ckpt is not None:
            self.ckpt.close()
        self.sink.close()
        if self.config.bench and self.ctx.is_main:
            print_bench(self.config, self.ctx.world_size, history)
        return history


def print_bench(config: TrainerConfig, world_size: int, history: list[dict]) -> None:
    fake = config.data.fake
    shape = f"seq {fake.seq_len} x mbs {fake.micro_batch_size} x bs {fake.batch_size}" if fake else "default fake"
    print(f"bench | {config.model.name} | {world_size} rank(s) | {shape} | {config.model.optimization_dtype}")
    print(bench_summary(history))
