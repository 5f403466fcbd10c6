"""What the API asks of an engine: `TrainingEngine` (the training routes), `Backend` (all the routes).

Both engines implement `TrainingEngine`: the training routes (api/training.py) are written once
against it and mounted on either app. `Backend` is an engine the API drives entirely (generation,
tokenizer, adapters): the embedded engine implements it, and any other engine can too. Also the
sampling parameters and output deltas passed across it. Nothing here imports torch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from asyncrl.inference.api.errors import InvalidRequest


@dataclass
class SamplingParams:
    """Per-request sampling; every field is already validated and resolved (max_tokens is concrete)."""

    max_tokens: int
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0): off
    min_p: float = 0.0
    seed: int | None = None
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: the sampled token's; k: plus the top k
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] = field(default_factory=dict)  # added to the logits before temperature
    prompt_logprobs: int | None = None  # None: none; 0: each prompt token's (raw model, T=1); k: plus the top k

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def filtered(self) -> bool:
        return self.top_p < 1.0 or self.top_k > 0 or self.min_p > 0.0


@dataclass
class PromptLogprobs:
    """Scores of a prompt under the raw model (temperature 1, no bias): for each position i >= 1, the
    log_softmax of the logits at i-1, in float32, evaluated at prompt token i (`logprobs[i-1]`), that token's
    rank (how many tokens score at least as high, itself included: vLLM's) and, when asked, the top k."""

    logprobs: list[float]
    ranks: list[int]
    top: list[list[tuple[int, float]]] | None = None

    def extend(self, other: PromptLogprobs) -> None:
        self.logprobs += other.logprobs
        self.ranks += other.ranks
        if other.top is not None:
            self.top = (self.top or []) + other.top


@dataclass
class SeqDelta:
    """What one sequence (choice `index`) produced since its last delta; `finish_reason` set on the last."""

    index: int
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None
    text: str
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    prompt_logprobs: PromptLogprobs | None = None  # on a sequence's first delta, when params.prompt_logprobs is set
    # on a finished sequence's last delta, from an engine recording MoE routes: uint8 numpy array
    # [prompt + completion - 1, MoE layers, top_k] (`transport.routes`; the last token was never forwarded)
    routed_experts: Any = None


class TrainingEngine(Protocol):
    """What RL training changes in a live engine; each call returns once the change is served."""

    model_name: str

    async def update_weights(self, weight_dir: str) -> dict[str, str] | None:
        """Load a HF safetensors dir into the live model (raise InvalidRequest if it does not fit); the
        fingerprints of what it loaded, by tensor name (transport/fingerprint.py), or None."""

    async def reload_weights(self) -> None:
        """Go back to the weights the server started with."""

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict[str, str] | None:
        """Register (or replace) a PEFT adapter; requests with model=lora_name then use it. The fingerprints of
        the adapter's tensors as loaded, or None."""

    async def unload_lora_adapter(self, lora_name: str) -> None:
        """Drop a loaded adapter (the route checked it is loaded); its name is free for another."""

    def lora_names(self) -> list[str]:
        """Names of the loaded adapters."""

    def lora_off(self) -> str | None:
        """Why no adapter can be loaded, as the client should hear it (None: adapters can be loaded)."""


class Backend(ABC):
    """An engine the whole API can serve (a `TrainingEngine` that also generates)."""

    model_name: str
    max_model_len: int
    vocab_size: int
    tokenizer: Any  # a HF tokenizer, used by the server for chat templates and (de)tokenizing; server thread only

    async def start(self) -> None:
        """Called once when the server starts."""

    async def shutdown(self) -> None:
        """Called once when the server stops."""

    @abstractmethod
    def generate(
        self, prompt_ids: list[int], params: SamplingParams, lora_name: str | None = None, stream: bool = True
    ) -> AsyncIterator[SeqDelta]:
        """Submit a request; the returned iterator streams deltas of its `params.n` sequences to the end.

        With `stream=False` the caller only wants the end result: each sequence may come as one delta,
        at its finish (same tokens, logprobs and text as the deltas joined).

        Called on the event loop. Raises InvalidRequest right away for a request the engine can never
        serve. Closing the iterator early (or abandoning it after starting it) aborts the request.
        """

    @abstractmethod
    async def update_weights(self, weight_dir: str) -> dict[str, str] | None:
        """Load a HF safetensors dir into the live model (raise InvalidRequest if it does not fit); the
        fingerprints of what it loaded, by tensor name (transport/fingerprint.py), or None."""

    @abstractmethod
    async def reload_weights(self) -> None:
        """Go back to the weights the server started with."""

    @abstractmethod
    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict[str, str] | None:
        """Register a PEFT adapter; requests with model=lora_name then use it (see TrainingEngine)."""

    @abstractmethod
    def lora_names(self) -> list[str]:
        """Names of the loaded adapters."""

    def lora_off(self) -> str | None:
        return None

    def is_healthy(self) -> bool:
        return True

    def resolve_model(self, name: str | None) -> str | None:
        """The adapter a request's `model` names (None: the base model); an unknown name is vLLM's 404."""
        if name is None or name == self.model_name:
            return None
        if name in self.lora_names():
            return name
        message = f"The model `{name}` does not exist. Valid aliases: {self.model_name}."
        raise InvalidRequest(message, param="model", status=404)
