"""Config of the `synthesize` entrypoint: roll out environments and write an SFT dataset."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from asyncrl.config.base import default_output_dir
from asyncrl.config.eval import EnvRunConfig


class SynthesizeConfig(EnvRunConfig):
    min_reward: float | None = Field(None, description="keep only rollouts with reward >= this")
    output: Path | None = Field(None, description="dataset file (.jsonl); default {output_dir}/synthetic/data.jsonl")
    split: Literal["train", "eval"] = Field("train", description="environment dataset split to roll out")
    output_dir: Path = Field(default_factory=default_output_dir, description="run directory")
