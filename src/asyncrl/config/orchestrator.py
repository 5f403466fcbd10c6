"""Config of the `orchestrator` entrypoint, and the env/client/sampling sections `eval`/`synthesize` reuse."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from asyncrl.config.base import (
    BaseConfig,
    CkptConfig,
    LogConfig,
    ModelConfig,
    WandbConfig,
    async_level_field,
    default_output_dir,
    fold_async_level,
)


class EndpointConfig(BaseConfig):
    """How to reach an OpenAI-compatible inference server."""

    host: str = Field("localhost", description="server host (ignored when base_url is set)")
    port: int = Field(8000, ge=1, le=65535, description="server port (ignored when base_url is set)")
    base_url: str | None = Field(None, description="full base URL, e.g. http://10.0.0.2:8000/v1")
    api_key_var: str = Field("OPENAI_API_KEY", description="environment variable holding the API key")
    timeout: float = Field(1200.0, gt=0, description="request timeout in seconds")
    health_timeout: float = Field(600.0, gt=0, description="seconds to wait for the server's /health at startup")

    @property
    def url(self) -> str:
        return self.base_url or f"http://{self.host}:{self.port}/v1"


class ClientConfig(EndpointConfig):
    """How to reach the OpenAI-compatible inference server."""

    merge_requests: bool = Field(
        True,
        description="send identical chat requests in flight together (a group's rollouts) as one request "
        "with n = k; each rollout still gets its own independently sampled answer",
    )


class SamplingConfig(BaseConfig):
    temperature: float = Field(1.0, ge=0, description="sampling temperature")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling (keep 1 for exact importance ratios)")
    top_k: int = Field(-1, ge=-1, description="top-k sampling, -1 = off (keep -1 for exact ratios)")
    min_p: float = Field(0.0, ge=0, le=1, description="min-p sampling (keep 0 for exact ratios)")
    max_tokens: int | None = Field(None, ge=1, description="max tokens per model turn (not per rollout)")
    seed: int | None = Field(None, description="sampling seed")
    extra_body: dict[str, Any] = Field(default_factory=dict, description="extra request fields for the server")


SECRET_VAR = "ASYNCRL_ENV_SECRET"  # an env server's shared secret: the default variable both sides read


class EnvServingConfig(BaseConfig):
    """Run a verifiers v1 environment's episodes in a standalone env server (verifiers' `serve_env`, ZMQ)."""

    address: str | None = Field(
        None,
        description="a running `env-server`'s address, e.g. tcp://10.0.0.3:5000: connect to it and start none "
        "(default: start one, a child process on a free local port)",
    )
    workers: int = Field(1, ge=1, description="worker processes of a server started here (above 1: verifiers' pool)")
    max_concurrent: int | None = Field(None, ge=1, description="episodes at once in a server started here")
    restarts: int = Field(3, ge=0, description="times a started server that dies is started again")
    startup_timeout: float = Field(120.0, gt=0, description="seconds for the server to answer its first health check")
    secret_var: str = Field(
        SECRET_VAR,
        description="environment variable holding the env server's shared secret (when set: ZeroMQ CURVE; the "
        "server needs the same secret in its own secret_var)",
    )

    @field_validator("address")
    @classmethod
    def _zmq_address(cls, address: str | None) -> str | None:
        return zmq_address(address) if address is not None else None


def zmq_address(address: str) -> str:
    """A ZMQ endpoint an env server binds or is reached at: tcp://HOST:PORT or ipc://PATH."""
    if not re.fullmatch(r"tcp://[^:/\s]+:\d{1,5}|ipc://\S+", address):
        raise ValueError("not a ZMQ address: give tcp://HOST:PORT (e.g. tcp://10.0.0.3:5000) or ipc://PATH")
    return address


class PoolConfig(BaseConfig):
    threshold: float = Field(
        description="a task whose latest mean group reward is <= this (and above the pools below) is here"
    )
    weight: float = Field(ge=0, description="its sampling weight (a task not yet seen: 1; 0: never drawn)")


def _default_pools() -> dict[str, PoolConfig]:
    return {
        "hard": PoolConfig(threshold=0.25, weight=0.2),
        "normal": PoolConfig(threshold=0.75, weight=1.0),
        "easy": PoolConfig(threshold=1.0, weight=0.2),
    }


class CurriculumConfig(BaseConfig):
    """Draw an environment's tasks by how the policy did on them lately (orchestrator/curriculum.py)."""

    type: Literal["difficulty_pools"] = Field("difficulty_pools", description="the one kind: difficulty pools")
    pools: dict[str, PoolConfig] = Field(
        default_factory=_default_pools,
        min_length=1,
        description="pools by inclusive threshold on a task's latest mean group reward, each with a weight",
    )


class EnvConfig(BaseConfig):
    id: str = Field("reverse-text", description="installed verifiers environment id (load_environment(id, **args))")
    args: dict[str, Any] = Field(default_factory=dict, description="keyword args for load_environment")
    name: str | None = Field(None, description="name for metrics (default: id)")
    ratio: float | None = Field(None, gt=0, description="sampling weight among several envs (default: equal)")
    curriculum: CurriculumConfig | None = Field(
        None, description="sample tasks by recent group reward (`curriculum = {}`: the default pools); default: uniform"
    )
    server: EnvServingConfig | None = Field(
        None,
        description="run the episodes in a standalone env server (`server = {}`: one started here; "
        "`server = {address = ...}`: one running elsewhere); default: in the orchestrator's process",
    )


class BufferConfig(BaseConfig):
    online_difficulty_filtering: bool = Field(False, description="drop groups whose rewards are all 0 or all 1")
    easy_threshold: float = Field(1.0, description="a group whose rewards are all >= this is too easy")
    hard_threshold: float = Field(0.0, description="a group whose rewards are all <= this is too hard")


class AdvantageConfig(BaseConfig):
    type: Literal["mean", "mean_std", "rloo", "opo"] = Field(
        "mean", description="mean: r - group mean; mean_std: /group std; rloo: leave-one-out; opo: length-weighted"
    )
    length_penalty: float = Field(
        0.0,
        ge=0,
        description="shape rewards first: r - w * max(group mean, 0) * length / group's longest (0: off)",
    )


class TeacherConfig(EndpointConfig):
    """The server of the model to distill from (on-policy distillation): it scores the student's exact tokens."""

    model: str | None = Field(None, description="the teacher's served model name (None: its /v1/models' first)")
    max_concurrent: int | None = Field(None, ge=1, description="scoring requests in flight at once (None: no cap)")
    timeout: float = Field(
        60.0,
        gt=0,
        description="seconds one scoring request may take (a prefill of a group's tokens); a teacher that lets two "
        "in a row time out stops the run",
    )


class DistillConfig(BaseConfig):
    kind: Literal["reverse_kl", "forward_kl"] = Field(
        "reverse_kl",
        description="reverse_kl: per-token advantage teacher_lp - sampler_lp on the sampled token (through the RL "
        "loss); forward_kl: the teacher's top-k distribution at every completion position travels in the batch and "
        "the trainer adds weight x cross-entropy to it (GKD's on-policy forward KL; needs top_k >= 1)",
    )
    weight: float = Field(
        1.0,
        ge=0,
        description="weight of the distillation signal (reverse_kl: of the per-token advantage; forward_kl: of the "
        "cross-entropy term)",
    )
    top_k: int = Field(
        0,
        ge=0,
        le=20,
        description="reverse_kl: a per-position baseline, the reverse KL at each position estimated from the "
        "teacher's and the student's top-k prompt logprobs (the student's from its own server: one more scoring "
        "request per sample), is added to each token's advantage; unbiased (0: off, the plain sampled-token signal). "
        "forward_kl: how many of the teacher's top tokens per position make its target distribution. docs/rl.md has "
        "what each measured",
    )
    clip: float | None = Field(
        None,
        gt=0,
        description="clamp each token's distillation term to [-clip, clip] (a sampled token the teacher all but "
        "rules out gives a rare, huge push; None: no clamp)",
    )


class RewardConfig(BaseConfig):
    weight: float | None = Field(
        None,
        ge=0,
        description="weight of the environment reward's advantage (None: 1.0 without a teacher, 0.0 with one)",
    )


class EvalConfig(BaseConfig):
    interval: int = Field(100, ge=1, description="evaluate every N steps")
    num_examples: int = Field(100, ge=-1, description="examples per env (-1: all)")
    rollouts_per_example: int = Field(1, ge=1, description="rollouts per example")
    env: list[EnvConfig] = Field(default_factory=list, description="eval environments (default: the train envs)")
    eval_base: bool = Field(True, description="also evaluate before the first step")
    eval_final: bool = Field(
        True, description="also evaluate the final policy (the weights of max_steps), logged as step max_steps"
    )


class OrchestratorConfig(BaseConfig):
    model: ModelConfig = Field(default_factory=ModelConfig, description="model name as served by the server")
    client: ClientConfig = Field(default_factory=ClientConfig, description="inference server client")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="sampling arguments")
    env: list[EnvConfig] = Field(default_factory=lambda: [EnvConfig()], description="training environments")
    buffer: BufferConfig = Field(default_factory=BufferConfig, description="rollout filtering")
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig, description="advantage estimator")
    teacher: TeacherConfig | None = Field(
        None, description="on-policy distillation from this teacher server (off unless set: [orchestrator.teacher])"
    )
    distill: DistillConfig = Field(default_factory=DistillConfig, description="on-policy distillation's weight")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="the environment reward's weight")
    eval: EvalConfig | None = Field(None, description="online evaluation (off unless set)")
    batch_size: int = Field(128, ge=1, description="samples (rollouts) per training step")
    rollouts_per_example: int = Field(8, ge=1, description="rollouts per prompt; must divide batch_size")
    oversampling_factor: float = Field(1.0, ge=1.0, description="generate this many times batch_size in flight")
    trajectory_strategy: Literal["interleaved", "branching"] = Field(
        "interleaved", description="interleaved: one sample per rollout; branching: one per turn"
    )
    seq_len: int = Field(2048, ge=1, description="tokens per packed micro-batch row (trainer's data.seq_len)")
    num_train_workers: int | None = Field(
        None,
        ge=1,
        description="trainer data-parallel ranks (equal micro-batch counts); default: what the trainer says in "
        "{output_dir}/trainer_world.json (rl sets it)",
    )
    episodes: Literal["direct", "verifiers"] = Field(
        "direct",
        description='verifiers v1 environments: "direct" runs an episode whose agents use the asyncrl-chat harness, '
        "the subprocess runtime and no tool servers without verifiers' per-episode transport (its model calls made "
        'in-process, a group\'s shared prompt sent once with n = k), recording the same traces; "verifiers" runs '
        "every episode through verifiers' own machinery",
    )
    renderer: dict[str, Any] | None = Field(
        None,
        description="verifiers v1 environments: the `renderers` config the training client renders prompts and "
        'parses replies with, e.g. {name = "default", tool_parser = "qwen3"} (tool calls through the model\'s '
        "own chat template); None: chosen from the model name",
    )
    share_prefix: bool = Field(
        True, description="pack each group's common prompt once; the trainer computes it once (--no-share-prefix: off)"
    )
    max_concurrent: int | None = Field(None, ge=1, description="cap on requests in flight (None: no cap)")
    lora_name: str | None = Field(
        None,
        description="serve each policy as this LoRA adapter on the server's unchanged base model (the trainer "
        "trains LoRA): /load_lora_adapter with broadcast/step_N/adapter instead of /update_weights, and requests "
        "name the adapter; several runs can share one server this way (None: full weight updates)",
    )
    max_steps: int | None = Field(None, ge=1, description="stop after this step")
    max_async_level: int = Field(2, ge=0, description="async bound k: rollouts of step n use policy >= n-k")
    async_lag: Literal["at_most", "exactly"] = Field(
        "at_most",
        description="at_most: step n samples with the newest policy >= n-k; exactly: with policy max(n-k, 0), "
        "waiting for it and passing over newer ones (asynchrony k as such, where generation, not training, is the "
        "bottleneck: a study knob; groups left from an older policy are dropped)",
    )
    async_level: int | None = async_level_field()
    weights_timeout: float | None = Field(
        None, gt=0, description="seconds to wait for the trainer's weights before failing (None: wait forever)"
    )
    output_dir: Path = Field(default_factory=default_output_dir, description="run directory shared with the trainer")
    ckpt: CkptConfig | None = Field(None, description="checkpoint progress (off unless set: --ckpt)")
    wandb: WandbConfig | None = Field(None, description="W&B logging (off unless set: --wandb)")
    log: LogConfig = Field(default_factory=LogConfig, description="logging")
    seed: int = Field(0, description="seed for prompt sampling")
    bench: bool = Field(False, description="benchmark rollouts/s and tokens/s against a running server")

    @model_validator(mode="before")
    @classmethod
    def _async_level(cls, raw: Any) -> Any:
        return fold_async_level(raw)

    @model_validator(mode="after")
    def _check(self) -> OrchestratorConfig:
        if self.batch_size % self.rollouts_per_example:
            raise ValueError(
                f"batch_size ({self.batch_size}) must be divisible by rollouts_per_example "
                f"({self.rollouts_per_example})"
            )
        if self.sampling.temperature == 0:
            raise ValueError(
                "sampling.temperature = 0: RL learns from sampled rollouts and their logprobs, which greedy "
                "decoding does not give; use a temperature > 0 (1.0 is exact for the importance ratios)"
            )
        if self.sampling.max_tokens is not None and self.sampling.max_tokens >= self.seq_len:
            raise ValueError(
                f"sampling.max_tokens ({self.sampling.max_tokens}) cannot fit in seq_len ({self.seq_len}) "
                "with a prompt; lower max_tokens or raise seq_len"
            )
        if not self.env:
            raise ValueError("at least one [[env]] is needed")
        self._check_distill()
        return self

    def _check_distill(self) -> None:
        if self.teacher is None and self.distill.weight != DistillConfig.model_fields["weight"].default:
            raise ValueError(
                f"distill.weight = {self.distill.weight} but there is no teacher to distill from: set "
                "[orchestrator.teacher] (the teacher's server, e.g. base_url) or drop distill.weight"
            )
        if self.reward_weight == 0 and self.distill_weight == 0:
            raise ValueError(
                "reward.weight = 0 and no distillation (no [orchestrator.teacher], or distill.weight = 0): nothing "
                "to learn from; raise reward.weight or set a teacher"
            )
        if self.distill.kind == "forward_kl" and self.distill.top_k == 0:
            raise ValueError(
                "distill.kind = 'forward_kl' needs the teacher's top tokens at each position: set distill.top_k "
                "(1-20, e.g. 20)"
            )
        if self.teacher is not None and self.teacher.url == self.client.url and self.lora_name is None:
            raise ValueError(
                f"orchestrator.teacher points at the student's own server ({self.client.url}); give the teacher's "
                "server (teacher.base_url, or teacher.host/port)"
            )

    @property
    def distill_weight(self) -> float:
        """The distillation advantage's weight in effect: 0 without a teacher."""
        return self.distill.weight if self.teacher is not None else 0.0

    @property
    def reward_weight(self) -> float:
        """The reward advantage's weight in effect: reward.weight, else 1.0 without a teacher and 0.0 with one."""
        if self.reward.weight is not None:
            return self.reward.weight
        return 0.0 if self.teacher is not None else 1.0
