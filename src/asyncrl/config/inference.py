"""Config of the `inference` entrypoint (OpenAI-compatible server; embedded or vLLM backend)."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, PrivateAttr, model_validator

from asyncrl.config.base import BaseConfig, LogConfig, ModelConfig, default_output_dir


class InferenceModelConfig(ModelConfig):
    dtype: Literal["auto", "float16", "bfloat16", "float32"] = Field(
        "auto",
        description="weights dtype (auto: float16 for a float32/float16 checkpoint, bfloat16 for a bfloat16 one; "
        "the embedded engine on CPU: float32)",
    )
    max_model_len: int | None = Field(None, ge=1, description="max context (prompt + completion) in tokens")
    enforce_eager: bool = Field(False, description="vLLM: disable CUDA graphs / compilation")
    trust_remote_code: bool = Field(False, description="allow custom modelling code from the model dir")
    enable_auto_tool_choice: bool = Field(False, description="parse tool calls from generated text")
    tool_call_parser: str | None = Field(
        None, description="tool-call format to parse (embedded engine: hermes; vLLM: any of its parsers)"
    )
    reasoning_parser: Literal["qwen3", "deepseek_r1"] | None = Field(
        None, description="split <think>...</think> into reasoning_content"
    )

    @model_validator(mode="after")
    def _tool_parser_needed(self) -> InferenceModelConfig:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs tool_call_parser (e.g. --model.tool-call-parser hermes)")
        return self


EMBEDDED_TOOL_PARSERS = ("hermes",)
# rl names the server it starts as a teacher `teacher` here: its log is logs/teacher.log, its run record teacher.pid
SERVER_ROLE_VAR = "ASYNCRL_SERVER_ROLE"


class ServerConfig(BaseConfig):
    host: str = Field("0.0.0.0", description="address to bind")
    port: int = Field(8000, ge=1, le=65535, description="port to bind")
    max_body_mib: float = Field(
        8.0, gt=0, description="largest request body in MiB; a larger one is refused (413) before it is read"
    )
    max_messages: int = Field(4096, ge=1, description="most chat messages in one request (more: 400)")
    max_header_kib: int = Field(64, ge=1, description="largest request line + headers in KiB (more: 431)")
    head_timeout_s: float = Field(
        10.0, gt=0, description="a request's line and headers must arrive within this (else 408 and closed)"
    )
    body_timeout_s: float = Field(
        60.0, gt=0, description="a request's body must arrive within this after its headers (else 408 and closed)"
    )
    keep_alive_timeout_s: float = Field(60.0, gt=0, description="an idle keep-alive connection is closed after this")


class InferenceConfig(BaseConfig):
    model: InferenceModelConfig = Field(default_factory=InferenceModelConfig, description="model to serve")
    server: ServerConfig = Field(default_factory=ServerConfig, description="HTTP server")
    backend: Literal["auto", "embedded", "vllm"] = Field(
        "auto", description="engine behind the API (auto: vLLM when it is installed and a CUDA GPU is visible)"
    )
    api_key: str | None = Field(None, description="require this bearer key on every endpoint but /health")
    trust_request_chat_template: bool = Field(
        False,
        description="render chat templates sent in requests (chat_template, chat_template_kwargs.chat_template) in a "
        "sandboxed worker bounded in time and memory; off: such requests are refused (vLLM's flag of the same name)",
    )
    allowed_weights_root: Path | None = Field(
        None, description="/update_weights and /load_lora_adapter load only dirs under this one (rl: its output_dir)"
    )
    max_lora_adapters: int = Field(
        64, ge=1, description="LoRA adapters loaded at once (/load_lora_adapter of one more name is refused: 409)"
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="embedded engine device")
    max_batch_size: int = Field(64, ge=1, description="embedded engine: sequences decoded together")
    num_threads: int | None = Field(
        None, ge=1, description="embedded engine: torch intra-op threads (default on CPU: one less than the cores)"
    )
    max_prefill_tokens: int = Field(
        4096,
        ge=1,
        description="embedded engine: prompt tokens one engine step admits and prefills (on CPU in forwards of at "
        "most 1024 tokens)",
    )
    kv_cache_gb: float | None = Field(
        None, gt=0, description="embedded engine: KV cache budget in GiB (default: 4 on CPU, half the free GPU memory)"
    )
    prefix_cache_gb: float = Field(
        1.0, ge=0, description="embedded engine: KV of finished sequences kept for prompts that extend them (0: off)"
    )
    enable_return_routed_experts: bool = Field(
        False,
        description="an MoE: record the experts every token was routed to and return them with each sample of "
        "/inference/v1/generate, for the trainer's router_replay (rl sets it; embedded engine only)",
    )
    seed: int | None = Field(
        None, description="seed the engine's random generator once at start (per-request seeds win)"
    )
    gpu_memory_utilization: float | None = Field(
        None,
        gt=0,
        le=1,
        description="fraction of GPU memory to use (vLLM: default 0.9; on CPU vLLM reads it as a fraction of RAM, "
        "default half of what is free; embedded engine on a GPU: caps weights + KV cache, default half the free)",
    )
    data_parallel_size: int = Field(1, ge=1, description="vLLM: data-parallel engines (all nodes)")
    tensor_parallel_size: int = Field(1, ge=1, description="vLLM: tensor-parallel size")
    data_parallel_size_local: int | None = Field(
        None, ge=1, description="vLLM multi-node: data-parallel engines on this node"
    )
    data_parallel_address: str | None = Field(None, description="vLLM multi-node: the head node's address")
    data_parallel_rpc_port: int | None = Field(
        None, ge=1, le=65535, description="vLLM multi-node: the head node's port for engine coordination"
    )
    data_parallel_start_rank: int | None = Field(
        None, ge=0, description="vLLM multi-node: the first data-parallel rank on this node (other nodes than the head)"
    )
    headless: bool = Field(False, description="vLLM multi-node: run this node's engines only, no API server")
    vllm_args: list[str] = Field(
        default_factory=list, description="extra vLLM CLI flags (unknown flags are passed through too)"
    )
    output_dir: Path = Field(default_factory=default_output_dir, description="where logs/ go")
    log: LogConfig = Field(default_factory=LogConfig, description="logging")

    _backend_why: str = PrivateAttr("set in the config")  # or why `auto` chose it

    # `inference --max-model-len N` (as in PRIME-RL's eval example) means `--model.max-model-len N`.
    cli_aliases: ClassVar[dict[str, str]] = {"max_model_len": "model.max_model_len"}
    # multi-node vLLM (PRIME-RL's docs: "Set DATA_PARALLEL_ADDRESS to head node IP"): read when no flag, file or
    # PRIME_ variable sets the option
    env_aliases: ClassVar[dict[str, str]] = {
        "DATA_PARALLEL_ADDRESS": "data_parallel_address",
        "DATA_PARALLEL_RPC_PORT": "data_parallel_rpc_port",
    }

    @model_validator(mode="after")
    def _choose_backend(self) -> InferenceConfig:  # first: the checks below see the engine that will run
        if self.backend == "auto":
            self.__dict__["backend"], why = auto_backend()  # (no re-validation of the whole model)
            self._backend_why = f"auto: {why}"
        return self

    @property
    def backend_why(self) -> str:
        """Why this engine: "set in the config", or why `auto` chose it."""
        return self._backend_why

    @model_validator(mode="after")
    def _multi_node_needs_vllm(self) -> InferenceConfig:
        env = {option: name for name, option in self.env_aliases.items()}
        asked = [
            f"--{k.replace('_', '-')}" + (f" (or {env[k]})" if k in env else "")
            for k in MULTI_NODE_FIELDS
            if getattr(self, k) not in (None, False)
        ]
        if asked and self.backend != "vllm":
            raise ValueError(
                f"{' '.join(asked)}: multi-node data parallelism is vLLM's; serve with --backend vllm "
                f"(engine here: embedded, {self._backend_why})"
            )
        return self

    @model_validator(mode="after")
    def _embedded_tool_parsers(self) -> InferenceConfig:
        parser = self.model.tool_call_parser
        if self.backend == "embedded" and parser is not None and parser not in EMBEDDED_TOOL_PARSERS:
            raise ValueError(
                f"the embedded engine parses {', '.join(EMBEDDED_TOOL_PARSERS)} tool calls only, not '{parser}'; "
                "serve with --backend vllm for vLLM's parsers"
            )
        return self

    @model_validator(mode="after")
    def _routes_need_embedded(self) -> InferenceConfig:
        if self.enable_return_routed_experts and self.backend != "embedded":
            raise ValueError(
                "enable_return_routed_experts (router_replay) needs the embedded engine: vLLM 0.32's routed-experts "
                "output (its Model Runner V2, GPU only) is not wired into asyncrl yet (engine here: "
                f"{self.backend}, {self._backend_why}); serve with --backend embedded, or train without router_replay"
            )
        return self

    @model_validator(mode="after")
    def _passthrough_only_for_vllm(self) -> InferenceConfig:
        if self.vllm_args and self.backend != "vllm":
            raise ValueError(
                f"unknown option(s) {' '.join(self.vllm_args)}: extra flags are passed through to vLLM only "
                "(add --backend vllm) — check the spelling with --help"
            )
        return self


MULTI_NODE_FIELDS = (
    "data_parallel_size_local",
    "data_parallel_address",
    "data_parallel_rpc_port",
    "data_parallel_start_rank",
    "headless",
)


@functools.cache
def auto_backend() -> tuple[str, str]:
    """The engine `backend = "auto"` picks, and why: vLLM (PRIME-RL's engine) when it is installed, here or in
    a vLLM environment beside this one, and a CUDA GPU is visible; otherwise the embedded engine."""
    from asyncrl.utils.vllm_env import vllm_python  # file checks only, never imports vllm

    if importlib.util.find_spec("vllm") is None and vllm_python() is None:
        return "embedded", "vLLM is not installed; scripts/install_vllm.sh installs it"
    from asyncrl.utils.cuda import cuda_available

    if not cuda_available():
        return "embedded", "no CUDA GPU is visible; vLLM on CPU needs --backend vllm"
    return "vllm", "vLLM is installed and a CUDA GPU is visible"


def chosen_backend(raw: dict) -> str:
    """The engine a raw (not yet validated) inference section will get."""
    backend = raw.get("backend", "auto")
    return auto_backend()[0] if backend == "auto" else backend
