"""Config of the `synthesize` entrypoint: roll out environments and write an SFT dataset."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from asyncrl.config.base import BaseConfig, LogConfig, ModelConfig, default_output_dir
from asyncrl.config.orchestrator import ClientConfig, EnvConfig, SamplingConfig


class SynthesizeConfig(BaseConfig):
    model: ModelConfig = Field(default_factory=ModelConfig, description="model name as the server knows it")
    client: ClientConfig = Field(default_factory=ClientConfig, description="OpenAI-compatible server")
    environment_ids: list[str] = Field(default_factory=list, description="comma-separated env ids (default args)")
    env: list[EnvConfig] = Field(default_factory=list, description="envs with args ([[env]] tables)")
    num_examples: int = Field(100, ge=-1, description="examples per env (-1: all)")
    rollouts_per_example: int = Field(1, ge=1, description="rollouts per example")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="sampling arguments")
    min_reward: float | None = Field(None, description="keep only rollouts with reward >= this")
    output: Path | None = Field(None, description="dataset file (.jsonl); default {output_dir}/synthetic/data.jsonl")
    max_concurrent: int | None = Field(None, ge=1, description="cap on requests in flight")
    server_wait: float = Field(30.0, ge=0, description="seconds to wait for the server to answer before failing")
    split: Literal["train", "eval"] = Field("train", description="environment dataset split to roll out")
    output_dir: Path = Field(default_factory=default_output_dir, description="run directory")
    log: LogConfig = Field(default_factory=LogConfig, description="logging")

    @model_validator(mode="after")
    def _check(self) -> "SynthesizeConfig":
        if not self.environment_ids and not self.env:
            raise ValueError("no environment to run: pass --environment-ids a,b or [[env]] tables")
        return self

    def envs(self) -> list[EnvConfig]:
        return [EnvConfig(id=i) for i in self.environment_ids] + list(self.env)
