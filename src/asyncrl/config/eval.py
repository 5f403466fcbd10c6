"""Config of the `eval` entrypoint, and the env-rollout fields it shares with `synthesize`."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from pydantic import Field, field_validator, model_validator

from asyncrl.config import loader
from asyncrl.config.base import BaseConfig, LogConfig, ModelConfig, WandbConfig, default_output_dir, report_field
from asyncrl.config.orchestrator import ClientConfig, EnvConfig, SamplingConfig

# PRIME-RL's `--benchmarks math500,aime24,aime25` names the AIME environments the older way
OLDER_BENCHMARK_NAMES = {"aime24": "aime2024", "aime25": "aime2025"}


class EnvRunConfig(BaseConfig):
    """Which environments to roll out against which server (shared by `eval` and `synthesize`)."""

    model: ModelConfig = Field(default_factory=ModelConfig, description="model name as the server knows it")
    client: ClientConfig = Field(default_factory=ClientConfig, description="OpenAI-compatible server")
    environment_ids: list[str] = Field(default_factory=list, description="comma-separated env ids (default args)")
    env: list[EnvConfig] = Field(default_factory=list, description="envs with args ([[env]] tables)")
    num_examples: int = Field(100, ge=-1, description="examples per env (-1: all)")
    rollouts_per_example: int = Field(1, ge=1, description="rollouts per example")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="sampling arguments")
    max_concurrent: int | None = Field(None, ge=1, description="cap on requests in flight")
    server_wait: float = Field(30.0, ge=0, description="seconds to wait for the server to answer before failing")
    log: LogConfig = Field(default_factory=LogConfig, description="logging")

    @field_validator("environment_ids")
    @classmethod
    def _older_benchmark_names(cls, ids: list[str]) -> list[str]:
        for old in (i for i in dict.fromkeys(ids) if i in OLDER_BENCHMARK_NAMES):
            loader.note_older_spelling(old, OLDER_BENCHMARK_NAMES[old])
        return [OLDER_BENCHMARK_NAMES.get(i, i) for i in ids]

    @model_validator(mode="after")
    def _some_env(self) -> EnvRunConfig:
        if not self.environment_ids and not self.env:
            raise ValueError("no environment to run: pass --environment-ids a,b or [[env]] tables")
        return self

    def envs(self) -> list[EnvConfig]:
        return [EnvConfig(id=i) for i in self.environment_ids] + list(self.env)


class EvalConfig(EnvRunConfig):
    cli_aliases: ClassVar[dict[str, str]] = {"env.id": "environment_ids", "benchmarks": "environment_ids"}

    endpoints_path: Path | None = Field(
        None,
        description="endpoints registry (Python file with ENDPOINTS = {name: {model, url, key}}): --model.name "
        "NAME resolves to its model, base URL and API-key variable (unset: configs/endpoints.py if present)",
    )
    weights_dir: Path | None = Field(None, description="evaluate every weights/step_N found here")
    steps: list[int] | None = Field(None, description="only these steps of weights_dir, e.g. 10,50")
    eval_base: bool = Field(True, description="also evaluate the base model (with weights_dir)")
    output_dir: Path = Field(default_factory=default_output_dir, description="results go to {output_dir}/eval")
    wandb: WandbConfig | None = Field(None, description="W&B logging (off unless set)")
    report: bool = report_field()

    @model_validator(mode="after")
    def _steps_need_dir(self) -> EvalConfig:
        if self.steps is not None and self.weights_dir is None:
            raise ValueError("--steps needs --weights-dir")
        return self
