"""Config building blocks shared by every entrypoint: the strict base model and common sections."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from asyncrl.config.notes import note_older_spelling


class BaseConfig(BaseModel):
    """Strict base: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())


class ModelConfig(BaseConfig):
    """The model every component loads (a HF hub name or a local directory)."""

    name: str = Field("Qwen/Qwen3-0.6B", description="HF model name or local directory")


class LogConfig(BaseConfig):
    level: Literal["debug", "info", "success", "warning", "error", "critical"] = Field(
        "info", description="console and file log level"
    )
    file: bool = Field(True, description="also write {output_dir}/logs/<component>.log")


class LogExtrasConfig(BaseConfig):
    samples: bool = Field(True, description="log sample rollouts as W&B tables")
    distributions: bool = Field(True, description="log reward/advantage/ratio distributions")
    interval: int = Field(10, ge=1, description="log extras every N steps")


class WandbConfig(BaseConfig):
    """Weights & Biases logging; absent (None) means W&B is off."""

    project: str = Field("asyncrl", description="W&B project")
    name: str | None = Field(None, description="run name (rl appends -trainer / -orchestrator)")
    id: str | None = Field(None, description="run id, to resume an existing W&B run")
    offline: bool = Field(False, description="log offline (sync later with `wandb sync`)")
    log_extras: LogExtrasConfig = Field(default_factory=LogExtrasConfig, description="samples/distributions")


class CkptConfig(BaseConfig):
    """Checkpointing; absent (None) means off, as in PRIME-RL."""

    path: Path = Field(
        Path("checkpoints"), description="checkpoint directory (relative: under output_dir; or an absolute path)"
    )
    interval: int = Field(50, ge=1, description="save every N steps")
    save_async: bool = Field(False, description="save in a background thread")
    keep_last: int | None = Field(None, ge=1, description="keep only the last N checkpoints")
    keep_interval: int | None = Field(
        None, ge=1, description="always keep checkpoints at multiples of N (on top of keep_last)"
    )
    resume_step: int | None = Field(None, ge=-1, description="resume from this step (-1 = latest)")


class FakeDataConfig(BaseConfig):
    """Shape of the trainer's fake data (`--data.fake`, for `trainer --bench`): `batch_size` samples of `seq_len`
    tokens, `samples_per_row` of them packed into each row (rows per forward: `data.micro_batch_size`)."""

    batch_size: int = Field(32, ge=1, description="samples per step")
    samples_per_row: int = Field(
        8, ge=1, description="samples packed into one row (rows per forward: data.micro_batch_size)"
    )
    seq_len: int = Field(128, ge=1, description="tokens per sample")
    micro_batch_size: int | None = Field(
        None, ge=1, exclude=True, description="older spelling (PRIME-RL's) of samples_per_row"
    )

    @model_validator(mode="before")
    @classmethod
    def _older_spelling(cls, raw: Any) -> Any:
        """PRIME-RL's `--data.fake "{'micro_batch_size': 8, ...}"` (or a file's / flag's): samples_per_row, one note."""
        if not isinstance(raw, dict) or raw.get("micro_batch_size") is None:
            return raw
        if "samples_per_row" in raw:
            raise ValueError("micro_batch_size is the older spelling of samples_per_row: set samples_per_row only")
        note_older_spelling("data.fake.micro_batch_size", "data.fake.samples_per_row")
        return {("samples_per_row" if k == "micro_batch_size" else k): v for k, v in raw.items()}

    @model_validator(mode="after")
    def _divides(self) -> FakeDataConfig:
        if self.batch_size % self.samples_per_row:
            raise ValueError(
                f"batch_size ({self.batch_size}) must be divisible by samples_per_row ({self.samples_per_row})"
            )
        return self


def default_output_dir() -> Path:
    return Path("outputs")


def report_field() -> Any:
    """`report` of the entrypoints that write a run report when they end (`--no-report` turns it off)."""
    return Field(True, description="write {output_dir}/report.html at the end, done or failed (asyncrl report)")


ASYNC_LEVEL_ALIAS = "async_level"  # the PRIME-RL docs' prose spelling of `max_async_level`


def async_level_field() -> Any:
    """`async_level`, accepted wherever `max_async_level` is (flag, TOML key) and folded into it before validation."""
    return Field(None, ge=0, exclude=True, description="the PRIME-RL docs' spelling of max_async_level (same option)")


def fold_async_level(raw: Any) -> Any:
    """`raw` with `async_level` renamed to `max_async_level`; both given with different values: ValueError."""
    if not isinstance(raw, dict) or ASYNC_LEVEL_ALIAS not in raw:
        return raw
    out = {k: v for k, v in raw.items() if k != ASYNC_LEVEL_ALIAS}
    alias, own = raw[ASYNC_LEVEL_ALIAS], out.get("max_async_level")
    if alias is None:
        return out
    if own is not None and str(own) != str(alias):
        raise ValueError(
            f"async_level = {alias!r} but max_async_level = {own!r}: they are one option (async_level is the "
            "PRIME-RL docs' spelling); set one"
        )
    out["max_async_level"] = own if own is not None else alias
    return out
