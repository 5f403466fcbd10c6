"""The RL loop: step n turns the packed rollouts `rollouts/step_n` into the policy `broadcast/step_{n+1}`.

Step n: wait for this rank's rows of `rollouts/step_n`, count the step's loss-mask tokens over all
ranks (one all-reduce before the first forward), run the rows forward/backward at most
`data.micro_batch_size` at a time (`rl.data.RowBatch`; rows of similar length together, see
`rl.data.plan_forwards`) with the policy-gradient loss (`trainer.loss`); the session clips and steps.
Every rank runs as many forward passes (the most any rank planned): FSDP's collectives stay in step.
Shared-prefix rows (`transport.prefix`) are computed once per prompt: sdpa and eager attention get the
rows' explicit 4D mask (bool for sdpa, additive 0 / dtype-min for eager, which adds it to the scores) and
logprobs are read at each token's logit parent; any other attention gets the rows expanded back to
plain ones (logged once). Rows without sharing take the plain path: no mask, logits at t-1.
With `model.router_replay` (an MoE) every forward routes its tokens to the experts the engine chose (`trainer.replay`).
Then publish `broadcast/step_{n+1}` (HF dir, STABLE last; also `weights/step_{n+1}` at checkpoint steps and the
end), checkpoint when due, and prune broadcast dirs outside the async window (except around kept
checkpoints) and consumed batches.

At start rank 0 writes `trainer_world.json` ({"world_size": N}, the data-parallel ranks: world / model.tp, as
the ranks of one tp group read the same rows): an orchestrator not told the trainer's rank count
(`num_train_workers`, as on a multi-node run started by hand) packs for N ranks.
A resumed run re-publishes the weights of its first step when they were pruned or are damaged (a file cut
short: `transport.weights`): the orchestrator resuming at that step waits for them. Runs in one plain
process (a 1-rank group is made on the fly) or under torchrun.
"""

from __future__ import annotations

import contextlib
import functools
import json
import time
from collections import defaultdict
from collections.abc import Callable

import torch
from loguru import logger

from asyncrl.config.base import FakeDataConfig
from asyncrl.config.trainer import TrainerConfig
from asyncrl.core import failpoint
from asyncrl.core.errors import UserError
from asyncrl.trainer.ckpt import complete_steps
from asyncrl.trainer.head import ENTROPY, LOGPROB, TEACHER_CE, TEACHER_KL, HeadRequest, head_setting, model_stats
from asyncrl.trainer.lora import adapters_off
from asyncrl.trainer.loss import get_loss_fn, mismatch_kl_sum
from asyncrl.trainer.model import DTYPES, load_model
from asyncrl.trainer.moe import log_part
from asyncrl.trainer.perf import format_mfu
from asyncrl.trainer.replay import RouterReplay, scoring_positions
from asyncrl.trainer.rl.data import (
    FakeSource,
    PackedRow,
    Part,
    RolloutSource,
    RowBatch,
    check_seq_len,
    concatenated_sizes,
    micro_batches,
    mixed_micro_batches,
    plan_forwards,
    prepare,
    split_to,
)
from asyncrl.trainer.runs import train_runs
from asyncrl.trainer.session import Loop, StepBatch, TrainSession, run_training
from asyncrl.transport.files import write_text_atomic
from asyncrl.transport.layout import RunLayout, is_stable
from asyncrl.transport.prefix import segments
from asyncrl.transport.row import Row
from asyncrl.transport.weights import weights_problem

MASKED_ATTENTION = ("sdpa", "eager")  # take an explicit 4D mask, so shared prefixes stay in one row
# a forward pass's fixed cost, as the FLOPs of this many tokens (CPU, tiny model: ~64; the plan is not sensitive)
FORWARD_OVERHEAD_TOKENS = 64
RATIO_QUANTILES = (0.01, 0.5, 0.99)  # of the importance ratio, logged every step
MASK_BUDGET_BYTES = 2**30  # a dense [rows, 1, L, L] mask beyond this: expand the rows instead (L = 32k: 1 GiB)


def train(config: TrainerConfig, layout: RunLayout) -> list[dict] | dict[str, list[dict]]:
    """Train until `max_steps` (or forever); returns the metrics of every step run (on every rank). With
    `max_concurrent_runs`, serve the runs under the output dir instead (`trainer.runs`): metrics by run."""
    if config.max_concurrent_runs is not None:
        return train_runs(config, layout, RLLoop)
    return run_training(config, layout, RLLoop)


class RLLoop(Loop):
    metrics_name = "trainer"

    def __init__(self, session: TrainSession) -> None:
        super().__init__(session)
        self.config: TrainerConfig = session.config
        self.loss_fn = get_loss_fn(self.config.loss)
        self._told_unshare = False
        self._dists: dict[str, list[torch.Tensor]] | None = None  # this step's, when W&B distributions are due
        self._log_ratios: list[torch.Tensor] = []  # this step's logπ - logμ on this rank's loss tokens
        self.reference: torch.nn.Module | None = None  # scores π_start when loss.ref_kl is set
        self.head = head_setting(self.config.model.fused_lm_head_chunk_size)  # how the loss reads the lm_head
        self.replay: RouterReplay | None = None  # router_replay: the engine's experts in every forward

    def start(self) -> None:
        s, cfg = self.session, self.config
        if cfg.bench or cfg.data.fake is not None:
            shape = cfg.data.fake or FakeDataConfig()
            self.source = FakeSource(shape, s.vocab_size, s.ctx.dp_rank, s.ctx.dp_size, cfg.seed)
        else:
            if cfg.model.router_replay:
                self.replay = RouterReplay(s.model, cfg.model.name)
            self.source = RolloutSource(
                s.layout, s.ctx.dp_rank, s.ctx.dp_size, cfg.recv_timeout, s.vocab_size, cfg.max_async_level
            )
            self.source.routing = self.replay.shape if self.replay is not None else None
            if s.ctx.is_main:  # an orchestrator without num_train_workers packs for this many ranks
                write_text_atomic(s.layout.trainer_world, json.dumps({"world_size": s.ctx.dp_size}))
        if cfg.loss.ref_kl is not None:
            self.reference = self._load_reference()

    def _load_reference(self) -> torch.nn.Module:
        """The start policy: a LoRA run's own model with its adapters off, else one frozen copy of the start weights."""
        s, cfg = self.session, self.config
        if s.lm.lora_scale is not None or s.lm.selector is not None:
            logger.info("ref_kl: the reference is the frozen base model (adapters off), no second copy")
            return s.model
        logger.info(f"ref_kl: loading a frozen copy of {cfg.model.name} as the reference (LoRA would need none)")
        ref = load_model(cfg.model.model_copy(update={"lora": None, "ac": None}), cfg.tokenizer.name, s.ctx.mesh).model
        return ref.requires_grad_(False).eval()

    # ---- one step ----------------------------------------------------------------------------------

    def next_batch(self, step: int, together: bool = False) -> StepBatch:
        ctx = self.session.ctx
        self._dists = defaultdict(list) if self.session.sink.extras_due(step, "distributions") else None
        start = time.perf_counter()
        rows, error = [], None
        try:
            mbs = check_seq_len(self.source.get(step), self.config.data.seq_len, step)
            rows = [prepare(mb, ctx.device) for mb in self._shareable(mbs)]
        except UserError as e:
            error = str(e)
        if (error := ctx.first_error(error)) is not None:  # every rank stops, with the one that could not read
            raise UserError(error)
        failpoint.reached("trainer.step", step)
        wait_s = time.perf_counter() - start
        loss_tokens, tokens, samples, flops = ctx.all_reduce_sum(self._counts(rows)).tolist()
        size, stack = self.config.data.micro_batch_size, self.session.lm.stackable
        mbs = rows if together else micro_batches(rows, size, stack, self._plan(rows))
        return StepBatch(
            mbs, int(loss_tokens), int(tokens), int(samples), flops, self.source.stamps, {"wait_s": wait_s}
        )

    def _plan(self, rows: list[PackedRow]) -> list[int]:
        """Rows per forward pass within `data.micro_batch_size` and `data.micro_batch_tokens`: padding-aware for
        stacked rows (`plan_forwards`), in order for concatenated ones; as many passes on every rank."""
        flops, data = self.session.flops, self.config.data
        lengths = sorted((r.input_ids.numel() for r in rows), reverse=True)  # micro_batches' order
        if self.session.lm.stackable:
            cost = functools.cache(lambda n: flops.row_flops(torch.tensor([n])))
            overhead = cost(FORWARD_OVERHEAD_TOKENS)
            sizes = plan_forwards(lengths, data.micro_batch_size, cost, overhead, data.micro_batch_tokens)
        else:
            sizes = concatenated_sizes(lengths, data.micro_batch_size, data.micro_batch_tokens)
        return split_to(sizes, self.session.ctx.all_reduce_max(len(sizes)))

    def _shareable(self, mbs: list[Row]) -> list[Row]:
        """The rows as they are, or unshared when the attention takes no explicit mask or the dense mask
        of one forward would pass MASK_BUDGET_BYTES (logged once)."""
        attn = self.session.model.config._attn_implementation
        if not any(segments(mb.position_ids).shared for mb in mbs):
            return mbs
        longest = max(mb.input_ids.numel() for mb in mbs)
        mask_bytes = longest**2 * min(self.config.data.micro_batch_size, len(mbs)) * (4 if attn == "eager" else 1)
        if attn in MASKED_ATTENTION and mask_bytes <= MASK_BUDGET_BYTES:
            return mbs
        plain = [mb.expanded() for mb in mbs]
        if not self._told_unshare and self.session.ctx.is_main:
            before, after = (sum(mb.input_ids.numel() for mb in x) for x in (mbs, plain))
            why = (
                f"attention '{attn}' cannot share prefixes in one row"
                if attn not in MASKED_ATTENTION
                else f"the shared-prefix mask would take {mask_bytes / 2**30:.1f} GiB per forward "
                f"(lower trainer.data.micro_batch_size or seq_len to keep sharing)"
            )
            logger.warning(f"{why}; expanding shared prefixes ({before:,} → {after:,} tokens per step on this rank)")
        self._told_unshare = True
        return plain

    def _counts(self, rows: list[PackedRow]) -> torch.Tensor:
        """This rank's loss tokens, tokens computed (a shared prefix once), samples with a loss token, FLOPs."""
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
        stats, mask = self._forward(mb)
        loss, finish = self.loss_terms(stats, mb, self._reference_logprobs(mb, mask))
        (loss * scale).backward()
        return finish()

    def _forward(self, mb: RowBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The policy's per-token statistics over `mb` ([rows, length, 4]: `trainer.head`), and the attention-mask
        kwargs they were computed with."""
        model = self.session.model
        mask = self.mask_kwargs(mb, model.config._attn_implementation)
        if self.replay is not None:
            self.replay.set(mb.routed_experts, scoring_positions(mb.loss_mask, mb.parents))
        request = HeadRequest(
            mb.input_ids, mb.temperatures, mb.parents, mb.teacher_ids, mb.teacher_targets, **self.head
        )
        return model_stats(model, request, **self._model_inputs(mb, mask)), mask

    @staticmethod
    def _model_inputs(mb: RowBatch, mask: dict[str, torch.Tensor]) -> dict:
        return {"input_ids": mb.input_ids, "position_ids": mb.position_ids, "use_cache": False, **mask}

    def loss_terms(
        self, stats: torch.Tensor, mb: RowBatch, ref_logprobs: torch.Tensor | None
    ) -> tuple[torch.Tensor, Callable[[], dict[str, torch.Tensor]]]:
        """This run's summed loss over `mb` (its token `stats`), and what gives its token sums once backward is done."""
        loss_cfg = self.config.loss
        inputs = mb.loss_inputs(stats[..., LOGPROB], ref_logprobs)
        out = self.loss_fn(inputs, loss_cfg)
        loss, entropy = out.loss, self._entropy_sum(stats[..., ENTROPY], mb)
        if loss_cfg.entropy_coef > 0:  # the entropy bonus (its gradient flows through the head's backward)
            loss = loss - loss_cfg.entropy_coef * entropy
        if mb.teacher_ids is not None:  # forward-KL distillation: the teacher's targets at every loss token
            loss = loss + stats[..., TEACHER_CE].sum()
            out.metrics["teacher_kl"] = stats[..., TEACHER_KL].sum()

        def finish() -> dict[str, torch.Tensor]:
            sums = {
                "loss": loss.detach().float(),
                "entropy": entropy.detach(),
                "mismatch_kl": mismatch_kl_sum(inputs),
            }
            log_ratio = (inputs.logprobs.detach() - inputs.inference_logprobs)[inputs.loss_mask]
            self._log_ratios.append(log_ratio)  # on the device: one copy to the host per step, in step_summary
            if self._dists is not None:  # rank 0's loss tokens
                self._dists["dist/importance_ratio"].append(log_ratio.exp().cpu())
                self._dists["dist/advantage"].append(inputs.advantages[inputs.loss_mask].cpu())
            for key, value in out.metrics.items():
                sums[key] = sums.get(key, 0) + value.detach().float()
            return sums

        return loss, finish

    @classmethod
    def forward_backward_together(cls, loops: list[RLLoop], batches: list[StepBatch]) -> list[dict[str, torch.Tensor]]:
        """One step of each run in shared forward passes: every run's rows planned together (longest first, as
        one run's are), each row through its own run's adapter (`SlotSelector.mixed`), each run's loss on its
        own rows scaled by its own step's loss tokens, one backward per forward. A run's gradient is then what
        it would be trained alone: its adapter sees only its rows, and its loss only their tokens."""
        lead = loops[0]
        s = lead.session
        scales = [loop.session.loss_scale(b) for loop, b in zip(loops, batches)]
        rows = [b.micro_batches for b in batches]
        sizes = lead._plan([r for rs in rows for r in rs]) if s.lm.stackable else None  # mixed: stacked rows only
        slots = [loop.session.slot.index for loop in loops]  # every rank: the same slots get gradients
        sums = [defaultdict(lambda: torch.zeros((), device=s.ctx.device)) for _ in loops]
        for mb, parts in mixed_micro_batches(rows, lead.config.data.micro_batch_size, s.lm.stackable, sizes):
            run_of_row = torch.cat([torch.full((p.b - p.a,), p.run) for p in parts]).to(s.ctx.device)
            with s.lm.selector.mixed(slots, run_of_row):
                for p, part_sums in zip(parts, cls._forward_backward_parts(loops, mb, parts, scales)):
                    for key, value in part_sums.items():
                        sums[p.run][key] += value
        return sums

    @staticmethod
    def _forward_backward_parts(
        loops: list[RLLoop], mb: RowBatch, parts: list[Part], scales: list[float]
    ) -> list[dict[str, torch.Tensor]]:
        """One forward over rows of several runs, each part's loss from its own run, one backward."""
        stats, mask = loops[0]._forward(mb)
        with_ref = [loops[p.run] for p in parts if loops[p.run].reference is not None]
        ref = with_ref[0]._reference_logprobs(mb, mask) if with_ref else None  # the base: one for every run
        total, finishers = 0.0, []
        for p in parts:
            loop = loops[p.run]
            sub = mb if len(parts) == 1 else mb.rows(p.a, p.b, p.teacher)
            ref_p = None if ref is None or loop.reference is None else ref[p.a : p.b]
            loss, finish = loop.loss_terms(stats[p.a : p.b], sub, ref_p)
            total = total + loss * scales[p.run]
            finishers.append(finish)
        total.backward()
        return [finish() for finish in finishers]

    @torch.no_grad()
    def _reference_logprobs(self, mb: RowBatch, mask: dict[str, torch.Tensor]) -> torch.Tensor | None:
        if self.reference is None:
            return None
        model = self.reference
        request = HeadRequest(mb.input_ids, mb.temperatures, mb.parents, **self.head)
        with adapters_off(model) if model is self.session.model else contextlib.nullcontext():
            return model_stats(model, request, **self._model_inputs(mb, mask))[..., LOGPROB]

    def step_summary(self) -> dict[str, float]:
        """Quantiles of this step's importance ratio r = π/μ over this rank's loss tokens (rank 0's are logged)."""
        log_ratio, self._log_ratios = torch.cat(self._log_ratios).cpu() if self._log_ratios else torch.zeros(0), []
        replay = self.replay.take() if self.replay is not None else {}
        if log_ratio.numel() == 0:
            return replay
        qs = torch.tensor(RATIO_QUANTILES, dtype=log_ratio.dtype)
        values = torch.quantile(log_ratio[: 2**24].float(), qs).exp().tolist()  # quantile's input limit
        out = {f"importance_ratio/p{round(q * 100):02d}": v for q, v in zip(RATIO_QUANTILES, values)}
        return out | replay | {"importance_ratio/max": float(log_ratio.max().exp())}

    def mask_kwargs(self, mb: RowBatch, attn: str) -> dict[str, torch.Tensor]:
        """No mask for plain rows (HF derives it from position_ids); shared rows' 4D mask as `attn` reads it."""
        if mb.attention_mask is None:
            return {}
        if attn == "sdpa":
            return {"attention_mask": mb.attention_mask}
        if attn == "eager":
            dtype = DTYPES[self.config.model.optimization_dtype]
            additive = torch.zeros(mb.attention_mask.shape, dtype=dtype, device=mb.attention_mask.device)
            return {"attention_mask": additive.masked_fill_(~mb.attention_mask, torch.finfo(dtype).min)}
        raise ValueError(f"attention '{attn}' cannot run shared-prefix rows; they must be unshared first")

    def _entropy_sum(self, entropy: torch.Tensor, mb: RowBatch) -> torch.Tensor:
        """Σ over `mb`'s loss tokens of the entropy ([rows, length]) of the distribution that sampled them."""
        if self._dists is not None:
            self._dists["dist/entropy"] += [e.detach()[m].cpu() for e, m in zip(entropy, mb.loss_mask.bool())]
        return (entropy * mb.loss_mask).sum()

    def take_distributions(self) -> dict[str, list[torch.Tensor]]:
        dists, self._dists = self._dists or {}, None
        return dists

    def bad_loss_hint(self, step: int) -> str:
        return (
            f", no weights written for step {step + 1} (lower optim.lr, or check the rollout batch "
            f"rollouts/step_{step})"
        )

    def batch_name(self, step: int) -> str:
        return f"the rollout batch {self.session.layout.batch_dir(step)}"

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
        keep = {s for c in complete_steps(layout) for s in range(c - k, c + 1)} if self.session.ckpt else set()
        layout.prune_broadcast(keep_from_step=step - k, keep=keep)
        layout.prune_batches(keep_from_step=step - 1)

    def restore(self, step: int, extra: dict) -> None:
        s = self.session
        if extra.get("world_size") != s.ctx.world_size:
            logger.warning(f"checkpoint was written by {extra.get('world_size')} ranks, resuming on {s.ctx.world_size}")
        logger.info(f"resumed from checkpoint step_{step} ({s.progress['tokens']:,} tokens so far)")
        # the orchestrator resuming at this step waits for these weights; re-publish them if pruned or damaged
        why = s.ctx.broadcast(self._republish_reason(step) if s.ctx.is_main else None)  # collective: ranks agree
        if why is not None:
            if why != "pruned":
                logger.warning(f"broadcast weights of step {step} are damaged ({why}): publishing them again")
            self._publish(step, keep_weights=False)

    def _republish_reason(self, step: int) -> str | None:
        """Why `broadcast/step_{step}` must be published again at resume ("pruned" or what is damaged), or None."""
        path = self.session.layout.broadcast_dir(step)
        return "pruned" if not is_stable(path) else weights_problem(path)

    def log_line(self, step: int, m: dict) -> str:
        if m.get("empty_step"):
            return f"step {step} | no loss tokens: not trained, weights unchanged | wait {m['wait_s']:.2f}s"
        return (
            f"step {step} | loss {m['loss']:.4f} | entropy {m['entropy']:.3f} | mismatch_kl {m['mismatch_kl']:.2e} | "
            f"masked {m.get('masked_frac', 0):.1%} | clipped {m.get('clipped_frac', 0):.1%} | "
            f"grad_norm {m['grad_norm']:.3f} | lr {m['lr']:.2e} | "
            f"{m['step_time_s']:.2f}s {m['tokens_per_s']:,.0f} tok/s | mfu {format_mfu(m['mfu'])} | "
            f"mem {m['peak_mem_gib']:.2f} GiB | wait {m['wait_s']:.2f}s"
            + (f" | teacher_kl {m['teacher_kl']:.4f}" if "teacher_kl" in m else "")
            + log_part(m)
        )

    def throughput_header(self) -> str:
        cfg, fake = self.config, self.config.data.fake
        shape = f"seq {fake.seq_len} x {fake.samples_per_row}/row x bs {fake.batch_size}" if fake else "default fake"
        world, rows, dtype = self.session.ctx.world_size, cfg.data.micro_batch_size, cfg.model.optimization_dtype
        return f"bench | {cfg.model.name} | {world} rank(s) | {shape} | {rows} rows/fwd | {dtype}"
