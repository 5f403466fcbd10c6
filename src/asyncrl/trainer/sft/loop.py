"""The SFT loop: `train_sft(config, layout)` fine-tunes on prompt/completion chat data.

Step n: take `data.batch_size` rows from the sample stream (a row is one sample, or with packing
several samples in at most `data.seq_len` tokens), deal them round-robin to the ranks, run this
rank's rows `data.micro_batch_size` at a time (stacked, each row a packed sequence); the session
clips and steps. The loss is the token-level cross-entropy summed over loss-mask tokens.

Outputs: `weights/step_N` (HF dir the server and `rl --model.name` load) at checkpoint steps and at
the end; `checkpoints/step_N/trainer` with the data position (`--ckpt`); `metrics/sft.jsonl`. Every
rank builds the same rows from the same stream, so the step totals need no collective and the data
position saved in a checkpoint is exact: a resumed run continues with the next unseen sample.
"""

from __future__ import annotations

import math
import time

import torch
from loguru import logger

from asyncrl.config.sft import SFTConfig
from asyncrl.core.errors import UserError
from asyncrl.trainer.head import LOGPROB, HeadRequest, head_setting, model_stats
from asyncrl.trainer.model import load_tokenizer
from asyncrl.trainer.moe import log_part
from asyncrl.trainer.perf import format_mfu
from asyncrl.trainer.session import Loop, StepBatch, TrainSession, run_training
from asyncrl.trainer.sft.data import ConversationTokenizer, SFTSample, fake_sample, load_sft_dataset
from asyncrl.trainer.sft.packing import SampleStream, SFTMicroBatch, make_micro_batch, split_for_rank, take_rows
from asyncrl.transport.layout import RunLayout

FAKE_SIZE = 1_000_000  # samples in the fake dataset (each made from its index)
EARLY_CHECK_ROWS = 8  # rows tokenized before the model loads, so template errors show at once


def train_sft(config: SFTConfig, layout: RunLayout) -> list[dict]:
    """Train until `max_steps` or the end of `epochs`; returns every step's metrics (on every rank)."""
    return run_training(config, layout, SFTLoop)


def check_batch_shape(batch_size: int, micro_batch_size: int, world_size: int) -> None:
    if batch_size % world_size or (batch_size // world_size) % micro_batch_size:
        raise UserError(
            f"data.batch_size ({batch_size}) must split evenly into {world_size} rank(s) x whole micro-batches of "
            f"data.micro_batch_size ({micro_batch_size}); use a batch_size that is a multiple of "
            f"{world_size * micro_batch_size}"
        )


class SFTLoop(Loop):
    metrics_name = "sft"

    def __init__(self, session: TrainSession) -> None:
        super().__init__(session)
        self.config: SFTConfig = session.config
        self.data = self.config.data
        check_batch_shape(self.data.batch_size, self.data.micro_batch_size, session.ctx.dp_size)
        self.dataset, self.conv = None, None
        if self.data.type == "dataset":  # before the model loads: a bad dataset or template fails fast
            self._load_dataset()

    def _load_dataset(self) -> None:
        cfg, d = self.config, self.data
        self.dataset = load_sft_dataset(d.name, d.split)
        tokenizer = load_tokenizer(cfg.tokenizer.name or cfg.model.name, cfg.model.trust_remote_code)
        self.conv = ConversationTokenizer(tokenizer, d.loss_roles, d.seq_len)
        for i in range(min(EARLY_CHECK_ROWS, len(self.dataset))):
            self.conv.tokenize_row(self.dataset[i], i)

    def start(self) -> None:
        tok = self.session.lm.tokenizer
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        self.stream = self._fake_stream() if self.dataset is None else self._dataset_stream()

    def _fake_stream(self) -> SampleStream:
        if not self.config.bench:
            logger.warning("training on fake random data (data.type = 'fake'); pass --data.name for real data")
        seq_len, vocab, seed = self.data.seq_len, self.session.vocab_size, self.config.seed
        return SampleStream(
            FAKE_SIZE,
            lambda i: fake_sample(i, seq_len, vocab, seed),
            shuffle=False,
            seed=self.data.seed,
            max_epochs=None,
        )

    def _dataset_stream(self) -> SampleStream:
        d, ds, max_steps = self.data, self.dataset, self.config.max_steps
        self.conv.truncated = 0
        max_epochs = None if max_steps else self.config.epochs
        repeat = f"repeating as needed for {max_steps} steps" if max_epochs is None else f"{max_epochs} epoch(s)"
        logger.info(f"dataset {d.name}: {len(ds):,} rows, {repeat}")
        return SampleStream(len(ds), self._trainable_sample, shuffle=d.shuffle, seed=d.seed, max_epochs=max_epochs)

    def _trainable_sample(self, i: int) -> SFTSample | None:
        sample = self.conv.tokenize_row(self.dataset[i], i)
        return sample if any(sample.loss_mask) else None

    def planned_steps(self) -> int | None:
        """max_steps, or (without packing) the steps in `epochs` epochs."""
        if self.session.max_steps is not None:
            return self.session.max_steps
        if not self.data.pack and self.dataset is not None:
            return math.ceil(len(self.dataset) * self.config.epochs / self.data.batch_size)
        return None

    # ---- one step ----------------------------------------------------------------------------------

    def next_batch(self, step: int) -> StepBatch | None:
        ctx, d = self.session.ctx, self.data
        start = time.perf_counter()
        rows = take_rows(self.stream, d.batch_size, d.seq_len, d.pack)
        if not rows:
            return None
        groups = split_for_rank(rows, d.batch_size, d.micro_batch_size, ctx.dp_rank, ctx.dp_size)
        mbs = [make_micro_batch(g, self.pad_id).to(ctx.device) for g in groups]
        data_s = time.perf_counter() - start
        samples = [s for row in rows for s in row]
        tokens = sum(len(s) for s in samples)
        return StepBatch(
            mbs,
            loss_tokens=sum(sum(s.loss_mask[1:]) for s in samples),
            tokens=tokens,
            samples=len(samples),
            flops=self.session.flops.row_flops(torch.tensor([len(s) for s in samples])),
            info=self._row_info(rows, tokens),
            timing={"data_s": data_s},
        )

    def _row_info(self, rows: list[list[SFTSample]], tokens: int) -> dict:
        return {
            "rows": len(rows),
            "epoch": self.stream.epoch,
            "data_index": self.stream.index,
            "pack_efficiency": tokens / (len(rows) * self.data.seq_len) if self.data.pack else None,
        }

    def forward_backward_step(self, mb: SFTMicroBatch, scale: float) -> dict[str, torch.Tensor]:
        ones = torch.ones(mb.input_ids.shape, device=mb.input_ids.device)
        request = HeadRequest(mb.input_ids, ones, **head_setting(self.config.model.fused_lm_head_chunk_size))
        kwargs = {"input_ids": mb.input_ids, "position_ids": mb.position_ids, "use_cache": False}
        logprobs = model_stats(self.session.model, request, **kwargs)[..., LOGPROB]
        targets = mb.loss_mask[:, 1:]
        if targets.any():
            loss = -logprobs[:, 1:][targets].sum()
        else:  # a dummy/empty micro-batch still runs backward so FSDP's collectives stay in step
            loss = logprobs.sum() * 0.0
        (loss * scale).backward()
        return {"loss": loss.detach().float()}

    def exhausted(self) -> bool:
        return self.stream.peek() is None

    def bad_loss_hint(self, step: int) -> str:
        return " (lower optim.lr)"

    # ---- outputs -----------------------------------------------------------------------------------

    def end_step(self, step: int, final: bool) -> dict[str, float]:
        ckpt_due = self.session.checkpoint_due(step, final)
        if ckpt_due or final:
            self._export(step)
        if ckpt_due:
            self.session.save_checkpoint(step)
        return {}

    def _export(self, step: int) -> None:
        path = self.session.layout.weights_dir(step)
        self.session.export([path])
        if self.session.ctx.is_main:
            logger.info(f"wrote weights {path}")

    def data_state(self) -> dict:
        return {"data": self.stream.state()}

    def restore(self, step: int, extra: dict) -> None:
        if "data" not in extra:
            raise UserError(
                f"checkpoint step_{step} under {self.session.out} is not an SFT checkpoint (no data position)"
            )
        self.stream.load_state(extra["data"])
        logger.info(
            f"resumed from checkpoint step_{step}: epoch {self.stream.epoch}, next sample {self.stream.index} "
            f"({self.session.progress['samples']:,} samples so far)"
        )

    def log_line(self, step: int, m: dict) -> str:
        # step is 0-based like the RL trainer's: step n yields weights step_{n+1}
        return (
            f"step {step} | loss {m['loss']:.4f} | grad_norm {m['grad_norm']:.3f} | lr {m['lr']:.2e} | "
            f"{m['samples']} samples in {m['rows']} rows | epoch {m['epoch']} | "
            f"{m['tokens_per_s']:,.0f} tok/s | mfu {format_mfu(m['mfu'])} | mem {m['peak_mem_gib']:.2f} GiB"
            + log_part(m)
        )

    def throughput_header(self) -> str:
        cfg, d = self.config, self.data
        data = "fake (variable length)" if d.type == "fake" else d.name
        return (
            f"bench | sft | {cfg.model.name} | {self.session.ctx.world_size} rank(s) | data {data} | seq {d.seq_len} x "
            f"mbs {d.micro_batch_size} x bs {d.batch_size} | pack {d.pack} | {cfg.model.optimization_dtype}"
        )

    def finish(self, history: list[dict], step: int) -> None:
        if not history:
            raise UserError("no training step ran: the dataset has no sample left to train on")
        if self.conv is not None and self.conv.truncated and self.session.ctx.is_main:
            logger.warning(
                f"{self.conv.truncated} samples were longer than data.seq_len ({self.data.seq_len}) "
                "and were truncated; raise --data.seq-len to keep them whole"
            )
        if self.session.ctx.is_main and not self.config.bench:
            logger.success(f"SFT done after {step} steps; final weights in {self.session.layout.weights_dir(step)}")
