"""Config of the `rl` launcher: the three component configs plus shared fields set once at the top.

Shared fields (`model`, `max_steps`, `seq_len`, `max_async_level`, `output_dir`, `wandb`, `ckpt`, `log`) are
propagated into every component that has them. A value may be set at the top or in any one component;
two different explicit values for the same shared field are an error, never a silent overwrite.
With `bench`, the benchmark job's settings (`asyncrl.bench.job`) fill in whatever the user left unset.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from asyncrl.bench import job as bench_job
from asyncrl.config import loader
from asyncrl.config.base import BaseConfig, CkptConfig, LogConfig, ModelConfig, WandbConfig
from asyncrl.config.inference import InferenceConfig
from asyncrl.config.orchestrator import OrchestratorConfig
from asyncrl.config.trainer import TrainerConfig
from asyncrl.utils.errors import UserError


class RLConfig(BaseConfig):
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="trainer (see `trainer --help`)")
    orchestrator: OrchestratorConfig = Field(
        default_factory=OrchestratorConfig, description="orchestrator (see `orchestrator --help`)"
    )
    inference: InferenceConfig | None = Field(
        None, description="start an inference server (off: use orchestrator.client's server)"
    )
    model: ModelConfig | None = Field(None, description="shared: model of all components")
    max_steps: int | None = Field(None, ge=1, description="shared: training steps")
    seq_len: int | None = Field(None, ge=1, description="shared: packed row length (and server context)")
    max_async_level: int | None = Field(None, ge=0, description="shared: async bound k (default 2)")
    output_dir: Path | None = Field(None, description="shared: run directory (default outputs)")
    wandb: WandbConfig | None = Field(None, description="shared: W&B (runs get -trainer/-orchestrator suffixes)")
    ckpt: CkptConfig | None = Field(None, description="shared: checkpointing of trainer and orchestrator")
    log: LogConfig | None = Field(None, description="shared: log level of all components")
    inference_gpu_ids: list[int] = Field(default_factory=lambda: [0], description="GPUs of the inference server")
    trainer_gpu_ids: list[int] = Field(default_factory=lambda: [1], description="GPUs of the trainer (one rank each)")
    trainer_cpu_processes: int = Field(1, ge=1, description="trainer ranks when running on CPU")
    cpu_placement: Literal["split", "pinned", "shared"] = Field(
        "split",
        description="without CUDA, how inference and trainer share the cores: split (half the threads each), "
        "pinned (split, each on its own cores), shared (every core to both, time-sharing)",
    )
    exp_id: str | None = Field(None, description="experiment id: runs in {output_dir}/{exp_id}, side by side")
    bench: bool = Field(
        False,
        description="benchmark: run the tiny-Qwen3 reverse-text job on a model it warms itself, print s/step, "
        "generation/training/weight-update time, overlap and held-out accuracy, write {output_dir}/bench.json "
        "(other flags still apply)",
    )

    @model_validator(mode="after")
    def _check(self) -> RLConfig:
        if self.inference is not None:
            mml = self.inference.model.max_model_len
            if mml is not None and mml < self.orchestrator.seq_len:
                raise ValueError(
                    f"inference.model.max_model_len ({mml}) is below seq_len ({self.orchestrator.seq_len}); "
                    "raise it or lower seq_len"
                )
        return self


# shared field -> where it lives in each component (None: component lacks it)
SHARED: dict[str, dict[str, tuple[str, ...] | None]] = {
    "model.name": {"trainer": ("model", "name"), "orchestrator": ("model", "name"), "inference": ("model", "name")},
    "max_steps": {"trainer": ("max_steps",), "orchestrator": ("max_steps",), "inference": None},
    "seq_len": {"trainer": ("data", "seq_len"), "orchestrator": ("seq_len",), "inference": None},
    "max_async_level": {"trainer": ("max_async_level",), "orchestrator": ("max_async_level",), "inference": None},
    "output_dir": {"trainer": ("output_dir",), "orchestrator": ("output_dir",), "inference": ("output_dir",)},
}
SHARED_SECTIONS = ("wandb", "ckpt", "log")


def _same(a: Any, b: Any) -> bool:
    return str(a) == str(b) if isinstance(a, (str, Path)) or isinstance(b, (str, Path)) else a == b


def propagate(raw: dict) -> dict:
    """Fill shared fields into components; raise UserError on contradicting explicit values."""
    raw = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}
    raw.setdefault("trainer", {})
    raw.setdefault("orchestrator", {})
    components = [c for c in ("trainer", "orchestrator", "inference") if isinstance(raw.get(c), dict)]

    for shared, where in SHARED.items():
        top = loader.get_path(raw, tuple(shared.split(".")))
        explicit = {"top level": top} if top is not None else {}
        for comp in components:
            path = where[comp]
            if path is not None and loader.get_path(raw[comp], path) is not None:
                explicit[comp] = loader.get_path(raw[comp], path)
        values = list(explicit.items())
        for name, value in values[1:]:
            if not _same(value, values[0][1]):
                first = values[0][0]
                first_key = shared if first == "top level" else f"{first}.{'.'.join(where[first])}"
                raise UserError(
                    f"contradicting {shared}: {first_key} = {values[0][1]!r} but "
                    f"{name}.{'.'.join(where[name])} = {value!r}; set it once (at the top level)"
                )
        if values:
            for comp in components:
                if where[comp] is not None:
                    loader.set_path(raw[comp], where[comp], values[0][1])

    for section in SHARED_SECTIONS:
        top = raw.get(section)
        if top is None:
            continue
        for comp in ("trainer", "orchestrator") if section != "log" else components:
            own = raw[comp].get(section) or {}
            for key, value in top.items():
                if key in own and not _same(own[key], value) and not (section == "wandb" and key == "name"):
                    raise UserError(
                        f"contradicting {section}.{key}: top level = {value!r} but {comp}.{section}.{key} = "
                        f"{own[key]!r}; set it once"
                    )
            merged = loader.deep_merge(top, own)
            if section == "wandb" and top.get("name") and "name" not in own:
                merged["name"] = f"{top['name']}-{comp}"
            raw[comp][section] = merged

    # a trainer resume implies the orchestrator resumes at the same step (PRIME-RL's `--trainer.ckpt.resume-step`)
    t_ckpt, o_ckpt = raw["trainer"].get("ckpt"), raw["orchestrator"].get("ckpt")
    if isinstance(t_ckpt, dict) and t_ckpt.get("resume_step") is not None:
        o_ckpt = dict(o_ckpt or {})
        o_ckpt.setdefault("resume_step", t_ckpt["resume_step"])
        raw["orchestrator"]["ckpt"] = o_ckpt

    # the orchestrator talks to the server rl starts, unless told otherwise
    if isinstance(raw.get("inference"), dict):
        client = dict(raw["orchestrator"].get("client") or {})
        port = loader.get_path(raw["inference"], ("server", "port"))
        if port is not None and "port" not in client and "base_url" not in client:
            client["port"] = port
        raw["orchestrator"]["client"] = client
        if (
            loader.get_path(raw, ("seq_len",)) is not None
            and loader.get_path(raw["inference"], ("model", "max_model_len")) is None
        ):
            loader.set_path(raw["inference"], ("model", "max_model_len"), raw["seq_len"])
    return raw


def resolve_rl(raw: dict, args: loader.ParsedArgs | None = None) -> RLConfig:
    if raw.get("bench"):
        raw = bench_job.apply_defaults(raw)
    raw = propagate(raw)
    if raw.get("exp_id"):
        base = raw.get("output_dir") or loader.get_path(raw["trainer"], ("output_dir",)) or "outputs"
        out = str(Path(base) / raw["exp_id"])
        for comp in ("trainer", "orchestrator", "inference"):
            if isinstance(raw.get(comp), dict):
                raw[comp]["output_dir"] = out
        raw["output_dir"] = out
    return loader.validate(RLConfig, raw)
