"""The RL loop: step n turns the packed rollouts `rollouts/step_n` into the policy `broadcast/step_{n+1}`.

Step n: wait for this rank's rows of `rollouts/step_n`, count the step's loss-mask tokens over all
ranks (one all-reduce before the first forward), run the rows forward/backward `data.micro_batch_size`
at a time (`rl.data.RowBatch`) with the policy-gradient loss (`trainer.loss`); the session clips and
steps. Every rank has as many rows, hence as many micro-batches: FSDP's collectives stay in step.
Then publish `broadcast/step_{n+1}` (HF dir, STABLE last; also `weights/step_{n+1}` at checkpoint steps and the
end), checkpoint when due, and prune broadcast dirs outside the async window (except around kept
checkpoints) and consumed batches.

A resumed run re-publishes the weights of its first step when they were pruned: the orchestrator
resuming at that step waits for them. Runs in one plain process (a 1-rank group is made on the fly)
or under torchrun.
"""

from __future__ import annotations

import time

import torch
from loguru import logger

from asyncrl.config.base import BenchDataConfig
from asyncrl.config.trainer import TrainerConfig
from asyncrl.trainer.ckpt import complete_steps
from asyncrl.trainer.loss import get_loss_fn, mismatch_kl_sum, token_entropy, token_logprobs
from asyncrl.trainer.perf import format_mfu
from asyncrl.trainer.rl.data import FakeSource, PackedRow, RolloutSource, RowBatch, micro_batches, prepare
from asyncrl.trainer.session import Loop, StepBatch, TrainSession, run_training
from asyncrl.transport.layout import is_stable


def train(config: TrainerConfig) -> list[dict]:
    """Train until `max_steps` (or forever); returns the metrics of every step run (on every rank)."""
    return run_training(config, RLLoop)


class RLLoop(Loop):
    metrics_name = "trainer"

    def __init__(self, session: TrainSession) -> None:
        super().__init__(session)
        self.config: TrainerConfig = session.config
        self.loss_fn = get_loss_fn(self.config.loss)

    def start(self) -> None:
        s, cfg = self.session, self.config
        if cfg.bench or cfg.data.fake is not None:
            shape = cfg.data.fake or BenchDataConfig()
            self.source = FakeSource(shape, s.vocab_size, s.ctx.rank, s.ctx.world_size, cfg.seed)
        else:
            self.source = RolloutSource(s.out, s.ctx.rank, s.ctx.world_size, cfg.recv_timeout)

    # ---- one step ----------------------------------------------------------------------------------

    def next_batch(self, step: int) -> StepBatch:
        ctx = self.session.ctx
        start = time.perf_counter()
        rows = [prepare(mb, ctx.device) for mb in self.source.get(step)]
        wait_s = time.perf_counter() - start
        loss_tokens, tokens, samples, flops = ctx.all_reduce_sum(self._counts(rows)).tolist()
        mbs = micro_batches(rows, self.config.data.micro_batch_size, self.session.lm.stackable)
        return StepBatch(mbs, int(loss_tokens), int(tokens), int(samples), flops, timing={"wait_s": wait_s})

    def _counts(self, rows: list[PackedRow]) -> torch.Tensor:
        """This rank's loss tokens, tokens, samples with a loss token, and FLOPs."""
        trained = (torch.bincount(r.sample_ids[r.loss_mask], minlength=r.num_samples).gt(0).sum() for r in rows)
        return torch.tensor(
            [
                sum(int(r.loss_mask.sum()) for r in rows),
                sum(r.input_ids.numel() for r in rows),
                sum(int(n) for n in trained),
                sum(self.session.flops.row_flops(r.sample_lengths) for r in rows),
            ],
            dtype=torch.float64,
        )

    def forward_backward_step(self, mb: RowBatch, scale: float) -> dict[str, torch.Tensor]:
        model = self.session.model
        logits = model(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False).logits
        inputs = mb.loss_inputs(token_logprobs(logits, mb.input_ids, mb.temperatures))
        out = self.loss_fn(inputs, self.config.loss)
        (out.loss * scale).backward()
        sums = {
            "loss": out.loss.detach().float(),
            # measured after backward, once the autograd graph is freed
            "entropy": self._entropy_sum(logits.detach(), mb),
            "mismatch_kl": mismatch_kl_sum(inputs),
        }
        for key, value in out.metrics.items():
            sums[key] = sums.get(key, 0) + value.detach().float()
        return sums

    @staticmethod
    def _entropy_sum(logits: torch.Tensor, mb: RowBatch) -> torch.Tensor:
        rows = zip(logits, mb.temperatures, mb.loss_mask)
        return sum((token_entropy(lg, t) * m).sum() for lg, t, m in rows)

    def bad_loss_hint(self, step: int) -> str:
        return (
            f", no weights written for step {step + 1} (lower optim.lr, or check the rollout batch "
            f"rollouts/step_{step})"
        )

    # ---- outputs -----------------------------------------------------------------------------------

    def end_step(self, step: int, final: bool) -> dict[str, float]:
        start = time.perf_counter()
        ckpt_due = self.session.checkpoint_due(step, final)
        self._publish(step, keep_weights=ckpt_due or final)
        if ckpt_due:
            self.session.save_checkpoint(step)
        if self.session.ctx.is_main:
            self._prune(step)
        return {"publish_s": time.perf_counter() - start}

    def _publish(self, step: int, keep_weights: bool) -> None:
        layout = self.session.layout
        self.session.export([layout.broadcast_dir(step)] + ([layout.weights_dir(step)] if keep_weights else []))

    def _prune(self, step: int) -> None:
        """Rank 0: drop broadcast dirs outside the async window (except around kept checkpoints), consumed batches."""
        layout, k = self.session.layout, self.config.max_async_level
        keep = {s for c in complete_steps(layout.root) for s in range(c - k, c + 1)} if self.session.ckpt else set()
        layout.prune_broadcast(keep_from_step=step - k, keep=keep)
        layout.prune_batches(keep_from_step=step - 1)

    def restore(self, step: int, extra: dict) -> None:
        s = self.session
        if extra.get("world_size") != s.ctx.world_size:
            logger.warning(f"checkpoint was written by {extra.get('world_size')} ranks, resuming on {s.ctx.world_size}")
        logger.info(f"resumed from checkpoint step_{step} ({s.progress['tokens']:,} tokens so far)")
        # the orchestrator resuming at this step waits for these weights; re-publish them if pruned
        if not is_stable(s.layout.broadcast_dir(step)):
            self._publish(step, keep_weights=False)

    def log_line(self, step: int, m: dict) -> str:
        return (
            f"step {step} | loss {m['loss']:.4f} | entropy {m['entropy']:.3f} | mismatch_kl {m['mismatch_kl']:.2e} | "
            f"masked {m.get('masked_frac', 0):.1%} | grad_norm {m['grad_norm']:.3f} | lr {m['lr']:.2e} | "
            f"{m['step_time_s']:.2f}s {m['tokens_per_s']:,.0f} tok/s | mfu {format_mfu(m['mfu'])} | "
            f"mem {m['peak_mem_gib']:.2f} GiB | wait {m['wait_s']:.2f}s"
        )

    def bench_header(self) -> str:
        cfg, fake = self.config, self.config.data.fake
        shape = f"seq {fake.seq_len} x {fake.micro_batch_size}/row x bs {fake.batch_size}" if fake else "default fake"
        world, rows, dtype = self.session.ctx.world_size, cfg.data.micro_batch_size, cfg.model.optimization_dtype
        return f"bench | {cfg.model.name} | {world} rank(s) | {shape} | {rows} rows/fwd | {dtype}"
