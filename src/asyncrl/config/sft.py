"""Config of the `sft` entrypoint: supervised fine-tuning on prompt/completion chat data."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from asyncrl.config.base import BaseConfig, CkptConfig, LogConfig, WandbConfig, default_output_dir, report_field
from asyncrl.config.trainer import OptimConfig, SchedulerConfig, TokenizerConfig, TrainerModelConfig


class SFTOptimConfig(OptimConfig):
    """The optimizer with SFT's own default learning rate (the RL trainer's is lower)."""

    lr: float = Field(2e-5, gt=0, description="AdamW learning rate")


class SFTDataConfig(BaseConfig):
    type: Literal["dataset", "fake"] = Field(
        "fake",
        description="dataset: data.name (a file/dir/hub name), the default once data.name is set; fake: random "
        "benchmark data, the default without data.name (with a warning)",
    )
    name: str | None = Field(None, description="local .jsonl/.parquet file or dir, or a HF hub dataset name")
    split: str = Field("train", description="dataset split")
    seq_len: int = Field(2048, ge=1, description="max tokens per row (longer samples are truncated)")
    batch_size: int = Field(
        32, ge=1, description="rows per optimizer step, all ranks (a row: one sample, or several when packing)"
    )
    micro_batch_size: int = Field(8, ge=1, description="rows per forward/backward on one rank")
    pack: bool = Field(True, description="fill each row with consecutive samples up to seq_len tokens")
    shuffle: bool = Field(True, description="shuffle every epoch")
    seed: int = Field(0, description="shuffle seed")
    loss_roles: list[str] = Field(
        default_factory=lambda: ["assistant"], description="roles of completion messages trained on"
    )

    @model_validator(mode="before")
    @classmethod
    def _type_follows_name(cls, raw: Any) -> Any:
        """No `type` given: dataset when data.name is set, else fake (a bare `sft`, `sft ... --bench`)."""
        if isinstance(raw, dict) and raw.get("type") is None:
            return {**raw, "type": "dataset" if raw.get("name") else "fake"}
        return raw

    @model_validator(mode="after")
    def _check(self) -> SFTDataConfig:
        if self.batch_size % self.micro_batch_size:
            raise ValueError(
                f"data.batch_size ({self.batch_size}) must be divisible by data.micro_batch_size "
                f"({self.micro_batch_size})"
            )
        if self.type == "dataset" and not self.name:
            raise ValueError("data.name is required: a .jsonl/.parquet file or dir, or a hub dataset name")
        return self


class SFTConfig(BaseConfig):
    model: TrainerModelConfig = Field(default_factory=TrainerModelConfig, description="model and parallelism")
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig, description="tokenizer")
    optim: SFTOptimConfig = Field(default_factory=SFTOptimConfig, description="optimizer")
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig, description="learning-rate schedule")
    data: SFTDataConfig = Field(default_factory=SFTDataConfig, description="training data")
    max_steps: int | None = Field(None, ge=1, description="stop after this many optimizer steps")
    epochs: int = Field(1, ge=1, description="passes over the data when max_steps is not set (else data repeats)")
    ckpt: CkptConfig | None = Field(None, description="checkpointing (off unless set: --ckpt)")
    wandb: WandbConfig | None = Field(None, description="W&B logging (off unless set: --wandb)")
    log: LogConfig = Field(default_factory=LogConfig, description="logging")
    output_dir: Path = Field(default_factory=default_output_dir, description="where weights/, checkpoints/, logs/ go")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="cuda if available, else cpu (gloo)")
    seed: int = Field(0, description="random seed")
    report: bool = report_field()
    bench: bool = Field(
        False, description="benchmark a few steps and print throughput/MFU (fake data unless data.name)"
    )
