"""Config of the `trainer` entrypoint (FSDP2 RL trainer) and the model/optimizer sections `sft` reuses."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from asyncrl.config.base import (
    BaseConfig,
    CkptConfig,
    FakeDataConfig,
    LogConfig,
    ModelConfig,
    WandbConfig,
    async_level_field,
    default_output_dir,
    fold_async_level,
)

Dtype = Literal["bfloat16", "float32"]

ADVANTAGE_TYPES = ("rloo", "opo")  # the orchestrator's advantage.type values PRIME-RL's docs call objectives
MICRO_BATCH_TOKENS = 16384  # a forward's activations grow with its tokens: at 16k-token rows, one row at a time
MICRO_BATCH_ROWS = 16  # fastest of 1/2/4/8/16 on the bench job's shape, CPU (benchmarks/trainer.py --rows-sweep)


class ACConfig(BaseConfig):
    freq: int = Field(1, ge=1, description="checkpoint activations of every Nth decoder layer (1 = all)")


class LoRAConfig(BaseConfig):
    rank: int = Field(16, ge=1, description="adapter rank")
    alpha: float = Field(32.0, gt=0, description="adapter scale numerator (scale = alpha / rank)")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter input")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        description="names of the linear layers that get adapters",
    )


class TrainerModelConfig(ModelConfig):
    optimization_dtype: Dtype = Field("float32", description="dtype of forward/backward compute")
    reduce_dtype: Dtype = Field("float32", description="dtype of gradient reduction across ranks")
    ac: ACConfig | None = Field(None, description="activation checkpointing (off unless set)")
    lora: LoRAConfig | None = Field(None, description="train LoRA adapters only (off unless set)")
    fsdp_cpu_offload: bool = Field(False, description="offload sharded params/grads/optimizer to CPU")
    tp: int = Field(
        1,
        ge=1,
        description="tensor parallelism: split each decoder layer's attention heads and MLP over this many ranks "
        "(dense models; must divide the ranks, attention heads and kv-heads); FSDP2 shards over ranks / tp",
    )
    ep: int = Field(
        1,
        ge=1,
        description="expert parallelism: each rank holds num_experts / ep of every MoE layer's experts and tokens "
        "go to them with all_to_all (MoE models; must divide the ranks and the experts); the ranks keep their data",
    )
    router_replay: bool = Field(
        False,
        description="an MoE: the loss routes each token to the experts the inference engine chose for it (R3; "
        "needs the embedded engine's routing records, which rl turns on); the router still learns",
    )
    attn_implementation: str = Field("sdpa", description="HF attention implementation")
    trust_remote_code: bool = Field(False, description="allow custom modelling code from the model dir")
    fused_lm_head_chunk_size: Annotated[int, Field(ge=1)] | Literal["disabled"] | None = Field(
        None,
        description="the loss reads the lm_head this many positions at a time and never holds the whole "
        "[tokens, vocab] logits (default: as many as fit 256 MiB of float32 logits); 'disabled': full logits",
    )

    @model_validator(mode="after")
    def _tp_full_weights(self) -> TrainerModelConfig:
        if self.tp > 1 and self.lora is not None:
            raise ValueError(f"model.tp = {self.tp} is not built for LoRA yet: drop --model.lora or set --model.tp 1")
        if self.ep > 1 and self.lora is not None:
            raise ValueError(f"model.ep = {self.ep} is not built for LoRA yet: drop --model.lora or set --model.ep 1")
        if self.ep > 1 and self.tp > 1:
            raise ValueError("model.ep and model.tp do not combine yet: set one of --model.ep 1 or --model.tp 1")
        return self


class TokenizerConfig(BaseConfig):
    name: str | None = Field(None, description="tokenizer name or dir (default: the model's)")


class OptimConfig(BaseConfig):
    lr: float = Field(1e-6, gt=0, description="AdamW learning rate")
    weight_decay: float = Field(0.01, ge=0, description="AdamW weight decay")
    betas1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1")
    betas2: float = Field(0.999, ge=0, lt=1, description="AdamW beta2")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon")
    max_norm: float = Field(1.0, ge=0, description="clip the global grad norm to this (0: no clipping)")


class SchedulerConfig(BaseConfig):
    type: Literal["constant", "linear", "cosine"] = Field("constant", description="learning-rate schedule")
    warmup_steps: int = Field(0, ge=0, description="linear warmup steps")
    decay_steps: int | None = Field(None, ge=1, description="steps to decay over (default: max_steps)")
    min_lr: float = Field(0.0, ge=0, description="final learning rate of linear/cosine decay")


class LossConfig(BaseConfig):
    """Policy-gradient loss: the objective, its importance-sampling guards and optional penalties."""

    type: Literal["aipo", "dppo", "grpo", "gspo", "cispo", "m2po", "custom"] = Field(
        "grpo",
        description="loss objective (grpo: PPO clip around the sampler; chosen by benchmarks/learning.py, see "
        "docs/learning.md; aipo was the default before)",
    )
    token_mask_low: float = Field(0.125, gt=0, description="aipo: mask tokens whose ratio is below this")
    token_mask_high: float = Field(8.0, gt=0, description="aipo: mask tokens whose ratio is above this")
    sequence_mask_low: float = Field(0.1, gt=0, description="mask samples whose geometric-mean ratio is below")
    sequence_mask_high: float = Field(10.0, gt=0, description="mask samples whose geometric-mean ratio is above")
    clip_low: float = Field(0.2, ge=0, description="grpo/gspo/cispo: lower clip epsilon")
    clip_high: float = Field(0.28, ge=0, description="grpo/gspo/cispo: upper clip epsilon")
    dppo_mask_low: float = Field(0.2, gt=0, le=1, description="dppo: drop A<=0 tokens whose probability fell more")
    dppo_mask_high: float = Field(0.2, gt=0, le=1, description="dppo: drop A>0 tokens whose probability rose more")
    m2_max: float = Field(
        0.04, gt=0, description="m2po: drop the largest-(log r)^2 tokens until their mean is at most this"
    )
    token_is_cap: float | None = Field(
        None, gt=0, description="token TIS: truncate each token's importance weight r at this (None: off)"
    )
    sequence_is_cap: float | None = Field(
        None, gt=0, description="sequence TIS: truncate the sample's geometric-mean ratio at this (None: off)"
    )
    kl_tau: float = Field(0.0, ge=0, description="add kl_tau * (logπ - logμ)^2 per token: a pull toward the sampler")
    ref_kl: float | None = Field(
        None,
        ge=0,
        description="add ref_kl * KL(π‖π_start) per token (k3): a pull toward the start weights; 0 logs the KL "
        "without the pull; each costs a no-grad forward of the reference (LoRA: the base model, no copy; full "
        "weights: one frozen copy) (None: off)",
    )
    entropy_coef: float = Field(0.0, ge=0, description="subtract entropy_coef * entropy per token (an entropy bonus)")
    custom: str | None = Field(None, description="custom loss as 'module.path:function' (type = custom)")

    @field_validator("type", mode="before")
    @classmethod
    def _advantage_not_loss(cls, value: Any) -> Any:
        """PRIME-RL's docs list RLOO and OPO among the training objectives; here they are advantage estimators."""
        if isinstance(value, str) and value.lower() in ADVANTAGE_TYPES:
            raise ValueError(
                f"{value.lower()} is an advantage estimator here, not a loss: set --orchestrator.advantage.type "
                f"{value.lower()} (rl; the orchestrator's own flag: --advantage.type) and keep a loss (default grpo)"
            )
        return value

    @model_validator(mode="after")
    def _custom_needs_path(self) -> LossConfig:
        if self.type == "custom" and not self.custom:
            raise ValueError("loss.type = 'custom' needs loss.custom = 'module.path:function'")
        if self.token_mask_low >= self.token_mask_high:
            raise ValueError("loss.token_mask_low must be below loss.token_mask_high")
        if self.sequence_mask_low >= self.sequence_mask_high:
            raise ValueError("loss.sequence_mask_low must be below loss.sequence_mask_high")
        return self


class TrainerDataConfig(BaseConfig):
    seq_len: int | None = Field(
        None,
        ge=1,
        description="longest packed row the trainer accepts, checked on every batch (rl sets it to the "
        "orchestrator's seq_len; None: no check)",
    )
    micro_batch_size: int = Field(
        MICRO_BATCH_ROWS, ge=1, description="packed rows per forward/backward (lower it on OOM; 1: one row at a time)"
    )
    micro_batch_tokens: int = Field(
        MICRO_BATCH_TOKENS,
        ge=1,
        description="at most this many tokens (rows x the longest's length) per forward/backward; a longer row "
        "runs alone",
    )
    fake: FakeDataConfig | None = Field(None, description="train on fake data of this shape (with --bench)")


class TrainerConfig(BaseConfig):
    model: TrainerModelConfig = Field(default_factory=TrainerModelConfig, description="model and parallelism")
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig, description="tokenizer")
    optim: OptimConfig = Field(default_factory=OptimConfig, description="optimizer")
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig, description="learning-rate schedule")
    loss: LossConfig = Field(default_factory=LossConfig, description="policy-gradient loss")
    data: TrainerDataConfig = Field(default_factory=TrainerDataConfig, description="input batches")
    ckpt: CkptConfig | None = Field(None, description="checkpointing (off unless set: --ckpt)")
    wandb: WandbConfig | None = Field(None, description="W&B logging (off unless set: --wandb)")
    log: LogConfig = Field(default_factory=LogConfig, description="logging")
    output_dir: Path = Field(
        default_factory=default_output_dir, description="run directory shared with the orchestrator"
    )
    max_steps: int | None = Field(None, ge=1, description="stop after this step (None: run until killed)")
    max_async_level: int = Field(2, ge=0, description="async bound k: keep broadcast weights of the last k+1 steps")
    async_level: int | None = async_level_field()
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="cuda if available, else cpu (gloo)")
    seed: int = Field(0, description="random seed")
    bench: bool = Field(False, description="benchmark on fake data for a few steps and print throughput/MFU")
    recv_timeout: float | None = Field(None, gt=0, description="seconds to wait for a batch before failing")
    max_concurrent_runs: int | None = Field(
        None,
        ge=1,
        description="multi-run: train up to N LoRA runs at once, one adapter each, found as {output_dir}/run_NAME/"
        "run.toml (needs model.lora; off unless set)",
    )
    runs: list[str] | None = Field(
        None, description="multi-run: end once these runs have ended (rl sets it; unset: serve runs until stopped)"
    )
    company_wait: float = Field(
        1.0,
        ge=0,
        description="multi-run: a run whose batch is ready waits up to this many step times (the last round's) for "
        "the other runs' batches, to train with them in shared forward passes (0: train whatever is ready)",
    )

    @model_validator(mode="before")
    @classmethod
    def _async_level(cls, raw: Any) -> Any:
        return fold_async_level(raw)

    @model_validator(mode="after")
    def _multi_run(self) -> TrainerConfig:
        if self.max_concurrent_runs is None:
            if self.runs is not None:
                raise ValueError("runs is a multi-run setting: set max_concurrent_runs too")
            return self
        if self.model.lora is None:
            raise ValueError(
                "max_concurrent_runs trains one LoRA adapter per run: add --model.lora (the base model is shared)"
            )
        if self.bench or self.data.fake is not None:
            raise ValueError("max_concurrent_runs trains runs' rollout batches: drop --bench / --data.fake")
        if self.model.router_replay:
            raise ValueError("model.router_replay is not built for multi-run training yet: drop one of the two")
        return self


class RunConfig(BaseConfig):
    """One run of a multi-run trainer, `{output_dir}/run_NAME/run.toml`: what differs from the trainer's
    own settings (unset: the trainer's)."""

    max_steps: int | None = Field(None, ge=1, description="the run's steps (default: the trainer's max_steps)")
    optim: OptimConfig | None = Field(None, description="the run's optimizer (own AdamW state in any case)")
    scheduler: SchedulerConfig | None = Field(None, description="the run's learning-rate schedule")
    loss: LossConfig | None = Field(None, description="the run's policy-gradient loss")
    ckpt: CkptConfig | None = Field(None, description="the run's checkpointing (under run_NAME/checkpoints)")
    seed: int | None = Field(None, description="the run's seed (adapter init, dropout)")
