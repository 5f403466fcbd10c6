"""The SFT training loop: `train_sft(config)` fine-tunes on prompt/completion chat data with FSDP2.

Shares the RL trainer's pieces: process group (`dist`), model loading + LoRA + activation
checkpointing + FSDP2 (`model`), AdamW and schedules (`optim`), DCP checkpoints (`ckpt`), HF weight
export (`weights`), FLOP/MFU accounting (`perf`) and the metrics sink (`monitor`).

Step n: take `data.batch_size` rows from the sample stream (a row is one sample, or with packing
several samples in at most `data.seq_len` tokens), deal them round-robin to the ranks, run this
rank's rows `data.micro_batch_size` at a time (stacked, each row a packed sequence),
and step the optimizer. The loss is the token-level cross-entropy over loss-mask tokens, divided by
the step's loss-token count over all ranks (times the world size, since FSDP2 averages gradients),
so it is the per-token mean over the step however rows are packed or sharded.

Outputs: `weights/step_N` (HF dir the server and `rl --model.name` load) at checkpoint steps and at
the end; `checkpoints/step_N/trainer` (model, optimizer, scheduler, data position) with `--ckpt`;
`metrics/sft.jsonl`. Every rank builds the same rows from the same stream, so the data position
saved in a checkpoint is exact: a resumed run continues with the next unseen sample.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from loguru import logger

from asyncrl.config.sft import SFTConfig
from asyncrl.trainer.ckpt import CheckpointManager, resolve_resume_step
from asyncrl.trainer.dist import DistContext, init_distributed
from asyncrl.trainer.export import export_weights
from asyncrl.trainer.model import LoadedModel, load_model, load_tokenizer
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
from asyncrl.trainer.sft.data import ConversationTokenizer, fake_sample, load_sft_dataset
from asyncrl.trainer.sft.packing import SampleStream, SFTMicroBatch, make_micro_batch, split_for_rank, take_rows
from asyncrl.transport.weights import weights_dir
from asyncrl.utils.errors import UserError
from asyncrl.utils.monitor import MetricsSink

BENCH_STEPS = 5  # --bench without --max-steps: one warm-up step + four timed ones
FAKE_SIZE = 1_000_000  # samples in the fake dataset (each made from its index)
EARLY_CHECK_ROWS = 8  # rows tokenized before the model loads, so template errors show at once


def train_sft(config: SFTConfig) -> list[dict]:
    """Train until `max_steps` or the end of `epochs`; returns every step's metrics (on every rank)."""
    ctx = init_distributed(config.device)
    try:
        return _SFTTrainer(config, ctx).run()
    finally:
        ctx.close()


def check_batch_shape(batch_size: int, micro_batch_size: int, world_size: int) -> None:
    if batch_size % world_size or (batch_size // world_size) % micro_batch_size:
        raise UserError(
            f"data.batch_size ({batch_size}) must split evenly into {world_size} rank(s) x whole micro-batches of "
            f"data.micro_batch_size ({micro_batch_size}); use a batch_size that is a multiple of "
            f"{world_size * micro_batch_size}"
        )


class _SFTTrainer:
    def __init__(self, config: SFTConfig, ctx: DistContext) -> None:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        self.config, self.ctx, self.data = config, ctx, config.data
        self.out = Path(config.output_dir)
        check_batch_shape(self.data.batch_size, self.data.micro_batch_size, ctx.world_size)
        self.max_steps = config.max_steps if config.max_steps or not config.bench else BENCH_STEPS
        self._dataset, self.conv = None, None
        if self.data.type == "dataset":  # before the model loads: a bad dataset or template fails fast
            self._dataset = load_sft_dataset(self.data.name, self.data.split)
            tokenizer = load_tokenizer(config.tokenizer.name or config.model.name, config.model.trust_remote_code)
            self.conv = ConversationTokenizer(tokenizer, self.data.loss_roles, self.data.seq_len)
            for i in range(min(EARLY_CHECK_ROWS, len(self._dataset))):
                self.conv.tokenize_row(self._dataset[i], i)
        torch.manual_seed(config.seed)
        self.lm: LoadedModel = load_model(config.model, config.tokenizer.name, ctx.mesh)
        self.model = self.lm.model
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        tok = self.lm.tokenizer
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        self.stream = self._build_stream()
        self.optimizer = build_optimizer(self.model, config.optim)
        self.scheduler = build_scheduler(self.optimizer, config.scheduler, self._planned_steps())
        self.flops = FlopModel.from_hf_config(self.lm.hf_config, self.lm.matmul_params)
        self.peak = peak_flops(ctx.device)
        self.ckpt = CheckpointManager(self.out, config.ckpt, ctx.rank) if config.ckpt and not config.bench else None
        self.progress = {"step": 0, "tokens": 0, "samples": 0}
        self.sink = MetricsSink(self.out, "sft", config.wandb, config.model_dump(mode="json"), ctx.is_main)

    # ---- setup -------------------------------------------------------------------------------------

    def _build_stream(self) -> SampleStream:
        d = self.data
        if self._dataset is None:
            if not self.config.bench:
                logger.warning("training on fake random data (data.type = 'fake'); pass --data.name for real data")
            vocab = self.model.get_input_embeddings().weight.shape[0]
            get = lambda i: fake_sample(i, d.seq_len, vocab, self.config.seed)  # noqa: E731
            return SampleStream(FAKE_SIZE, get, shuffle=False, seed=d.seed, max_epochs=None)
        ds, conv = self._dataset, self.conv
        conv.truncated = 0

        def get(i: int):
            sample = conv.tokenize_row(ds[i], i)
            return sample if any(sample.loss_mask) else None

        max_epochs = None if self.config.max_steps else self.config.epochs
        logger.info(
            f"dataset {d.name}: {len(ds):,} rows, "
            + (
                f"repeating as needed for {self.config.max_steps} steps"
                if max_epochs is None
                else f"{max_epochs} epoch(s)"
            )
        )
        return SampleStream(len(ds), get, shuffle=d.shuffle, seed=d.seed, max_epochs=max_epochs)

    def _planned_steps(self) -> int | None:
        """Steps the schedule decays over: max_steps, or (without packing) the steps in `epochs` epochs."""
        if self.max_steps is not None:
            return self.max_steps
        if not self.data.pack and self._dataset is not None:
            return math.ceil(len(self._dataset) * self.config.epochs / self.data.batch_size)
        return None

    def _resume(self) -> int:
        cfg = self.config.ckpt
        if self.ckpt is None or cfg.resume_step is None:
            return 0
        step = resolve_resume_step(self.out, cfg.resume_step, self.max_steps)
        extra = self.ckpt.load(step, self.model, self.optimizer)
        if "data" not in extra:
            raise UserError(f"checkpoint step_{step} under {self.out} is not an SFT checkpoint (no data position)")
        self.scheduler.load_state_dict(extra["scheduler"])
        self.progress = extra["progress"]
        self.stream.load_state(extra["data"])
        logger.info(
            f"resumed from checkpoint step_{step}: epoch {self.stream.epoch}, next sample {self.stream.index} "
            f"({self.progress['samples']:,} samples so far)"
        )
        return step

    # ---- one step ----------------------------------------------------------------------------------

    def _forward_backward(self, mbs: list[SFTMicroBatch], scale: float) -> torch.Tensor:
        loss_sum = torch.zeros((), device=self.ctx.device)
        for mb in mbs:
            logits = self.model(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False).logits
            targets = mb.loss_mask[:, 1:]
            if targets.any():
                loss = F.cross_entropy(logits[:, :-1][targets].float(), mb.input_ids[:, 1:][targets], reduction="sum")
            else:  # a dummy/empty micro-batch still runs backward so FSDP's collectives stay in step
                loss = logits.sum() * 0.0
            (loss * scale).backward()
            loss_sum += loss.detach().float()
            del logits, loss
        return loss_sum

    def _step(self, step: int) -> dict | None:
        ctx, d = self.ctx, self.data
        start = time.perf_counter()
        rows = take_rows(self.stream, d.batch_size, d.seq_len, d.pack)
        if not rows:
            return None
        groups = split_for_rank(rows, d.batch_size, d.micro_batch_size, ctx.rank, ctx.world_size)
        mbs = [make_micro_batch(g, self.pad_id).to(ctx.device) for g in groups]
        data_s = time.perf_counter() - start
        # every rank holds the same rows, so step totals need no collective
        samples = [s for row in rows for s in row]
        loss_tokens = sum(sum(s.loss_mask[1:]) for s in samples)
        tokens = sum(len(s) for s in samples)
        flops = self.flops.row_flops(torch.tensor([len(s) for s in samples]))
        denom = max(loss_tokens, 1)

        reset_peak_memory(ctx.device)
        compute_start = time.perf_counter()
        local = self._forward_backward(mbs, ctx.world_size / denom)
        loss = float(ctx.all_reduce_sum(local[None])[0]) / denom
        if not math.isfinite(loss):
            raise UserError(f"loss is {loss} at step {step}; stopped before the optimizer step (lower optim.lr)")
        grad_norm, lr = apply_gradients(self.params, self.optimizer, self.scheduler, self.config.optim.max_norm, step)
        compute_s = time.perf_counter() - compute_start

        self.progress = {
            "step": step + 1,
            "tokens": self.progress["tokens"] + tokens,
            "samples": self.progress["samples"] + len(samples),
        }
        return {
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": lr,
            "tokens": tokens,
            "loss_tokens": loss_tokens,
            "samples": len(samples),
            "rows": len(rows),
            "epoch": self.stream.epoch,
            "data_index": self.stream.index,
            "pack_efficiency": tokens / (len(rows) * d.seq_len) if d.pack else None,
            "step_time_s": compute_s,
            "data_s": data_s,
            "tokens_per_s": tokens / compute_s,
            "mfu": mfu(flops, compute_s, self.peak, ctx.world_size),
            "peak_mem_gib": peak_memory_gib(ctx.device),
        }

    # ---- outputs -----------------------------------------------------------------------------------

    def _export(self, step: int) -> None:
        export_weights(
            self.model,
            [weights_dir(self.out, step)],
            self.lm.hf_config,
            self.lm.tokenizer,
            self.lm.export_dtype,
            self.lm.lora_scale,
            self.ctx.is_main,
            getattr(self.model, "generation_config", None),
        )
        if self.ctx.is_main:
            logger.info(f"wrote weights {weights_dir(self.out, step)}")

    def _log(self, step: int, m: dict) -> None:
        if not self.ctx.is_main:
            return
        logger.info(
            f"step {step} | loss {m['loss']:.4f} | grad_norm {m['grad_norm']:.3f} | lr {m['lr']:.2e} | "
            f"{m['samples']} samples in {m['rows']} rows | epoch {m['epoch']} | "
            f"{m['tokens_per_s']:,.0f} tok/s | mfu {format_mfu(m['mfu'])} | mem {m['peak_mem_gib']:.2f} GiB"
        )
        self.sink.log(step, m)

    def run(self) -> list[dict]:
        step = self._resume()
        history: list[dict] = []
        exported = None
        while self.max_steps is None or step < self.max_steps:
            metrics = self._step(step)
            if metrics is None:
                break
            step += 1
            final = step == self.max_steps or self.stream.peek() is None
            ckpt_due = self.ckpt is not None and self.ckpt.due(step, final)
            if not self.config.bench and (ckpt_due or final):
                self._export(step)
                exported = step
            if ckpt_due:
                self.ckpt.save(
                    step,
                    self.model,
                    self.optimizer,
                    {
                        "progress": self.progress,
                        "data": self.stream.state(),
                        "scheduler": self.scheduler.state_dict(),
                        "world_size": self.ctx.world_size,
                    },
                )
            self._log(step - 1, metrics)  # 0-based like the RL trainer: step n yields weights step_{n+1}
            history.append(metrics)
            if final:
                break
        if not history:
            raise UserError("no training step ran: the dataset has no sample left to train on")
        if self.conv is not None and self.conv.truncated and self.ctx.is_main:
            logger.warning(
                f"{self.conv.truncated} samples were longer than data.seq_len ({self.data.seq_len}) "
                "and were truncated; raise --data.seq-len to keep them whole"
            )
        if self.ckpt is not None:
            self.ckpt.close()
        self.sink.close()
        if self.ctx.is_main:
            if self.config.bench:
                print_bench(self.config, self.ctx.world_size, history)
            elif exported is not None:
                logger.success(f"SFT done after {step} steps; final weights in {weights_dir(self.out, exported)}")
        return history


def print_bench(config: SFTConfig, world_size: int, history: list[dict]) -> None:
    d = config.data
    data = "fake (variable length)" if d.type == "fake" else d.name
    print(
        f"bench | sft | {config.model.name} | {world_size} rank(s) | data {data} | seq {d.seq_len} x "
        f"mbs {d.micro_batch_size} x bs {d.batch_size} | pack {d.pack} | {config.model.optimization_dtype}"
    )
    print(bench_summary(history))
