"""Request bodies of the server's routes (pydantic), validated strictly, and their mapping to SamplingParams.

Unknown fields are accepted and ignored (clients send provider-specific extras); known fields are
type- and range-checked as strictly as the OpenAI API (no "yes" for a bool, no "0.5" for a number; message
roles, content and tools checked) so a bad value is a 400, never an engine error. NaN/inf are refused.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from asyncrl.inference.api.backend import SamplingParams
from asyncrl.inference.api.errors import InvalidRequest

MAX_TOP_LOGPROBS = 20
Finite = dict(allow_inf_nan=False)


ROLES = ("system", "developer", "user", "assistant", "tool", "function")


# What the OpenAPI schema says messages and tools look like (checked by `check_message` and `ChatShape`; the
# fields stay plain dicts so unknown keys pass through to the chat template)
_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}  # fmt: skip
MESSAGE_SCHEMA = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {
        "role": {"enum": list(ROLES)},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}]},
        "name": {"type": "string"},
    },
}
TOOL_SCHEMA = {
    "type": "object",
    "required": ["type", "function"],
    "properties": {
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "minLength": 1},
                "description": {"type": "string"},
                "parameters": {"type": "object"},
            },
        },
    },
}


def _items_doc(items: dict[str, Any]):
    """json_schema_extra: the array (or the array branch of an optional field) documents its `items`."""

    def extra(schema: dict[str, Any]) -> None:
        for branch in schema.get("anyOf", [schema]):
            if branch.get("type") == "array":
                branch["items"] = items

    return extra


_MESSAGES_DOC, _TOOLS_DOC = _items_doc(MESSAGE_SCHEMA), _items_doc(TOOL_SCHEMA)


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", protected_namespaces=(), strict=True)


class SamplingFields(_Body):
    """Sampling knobs shared by every generating route (OpenAI names plus vLLM's extras)."""

    n: int = Field(1, ge=1, le=1024)
    temperature: float | None = Field(None, ge=0, **Finite)
    top_p: float | None = Field(None, gt=0, le=1, **Finite)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1, **Finite)
    max_tokens: int | None = Field(None, ge=1)
    min_tokens: int = Field(0, ge=0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    presence_penalty: float = Field(0.0, **Finite)
    frequency_penalty: float = Field(0.0, **Finite)
    repetition_penalty: float = Field(1.0, gt=0, **Finite)
    logit_bias: dict[int, float] | None = None

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias_keys(cls, v: Any) -> Any:
        """JSON object keys are strings: {"50256": -100} names token 50256."""
        if isinstance(v, dict):
            try:
                return {int(k) if isinstance(k, str) else k: b for k, b in v.items()}
            except ValueError:
                raise ValueError("logit_bias keys must be token ids") from None
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[int, float] | None) -> dict[int, float] | None:
        for token, bias in (v or {}).items():
            if token < 0 or not -100 <= bias <= 100:
                raise ValueError(f"logit_bias needs token ids >= 0 and biases in [-100, 100], got {token}: {bias}")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        return v

    @model_validator(mode="after")
    def _unsupported(self) -> SamplingFields:
        if self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0:
            raise ValueError("presence/frequency/repetition penalties are not supported; leave them at 0/0/1")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        return self

    def check_vocab(self, vocab_size: int, prefix: str = "") -> None:
        """Token ids in stop_token_ids / logit_bias must exist."""
        check_token_ids(self.stop_token_ids or [], vocab_size, f"{prefix}stop_token_ids")
        check_token_ids(list(self.logit_bias or {}), vocab_size, f"{prefix}logit_bias")

    def to_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        top_k = self.top_k if self.top_k is not None and self.top_k > 0 else -1
        return SamplingParams(
            max_tokens=max_tokens,
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=top_k,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            min_tokens=min(self.min_tokens, max_tokens),
            stop=stops,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=dict(self.logit_bias or {}),
        )


class StreamOptions(_Body):
    include_usage: bool = False


class ChatShape(_Body):
    """What every chat request must look like, whatever the engine: message roles and content, tools, and
    JSON types (vLLM's own chat route is given this check first; it validates values itself)."""

    messages: list[dict[str, Any]] = Field(..., min_length=1, json_schema_extra=_MESSAGES_DOC)
    tools: list[dict[str, Any]] | None = Field(None, json_schema_extra=_TOOLS_DOC)
    stream: bool = False
    n: int | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    @field_validator("messages")
    @classmethod
    def _messages(cls, v: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for i, m in enumerate(v):
            check_message(i, m)
        return v

    @field_validator("tools")
    @classmethod
    def _tools(cls, v: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for i, tool in enumerate(v or []):
            function = tool.get("function")
            if tool.get("type") != "function" or not isinstance(function, dict) or not function.get("name"):
                raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., ...}}}}")
        return v


class ChatCompletionRequest(SamplingFields, ChatShape):
    model: str | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        if isinstance(v, str) and v not in ("none", "auto", "required"):
            raise ValueError("tool_choice must be 'none', 'auto', 'required' or a named function")
        return v

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprobs_k(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise InvalidRequest("top_logprobs needs logprobs=true", param="top_logprobs")
            return None
        return self.top_logprobs or 0


class ChatCompletionTokensRequest(ChatCompletionRequest):
    """/v1/chat/completions/tokens: a chat request whose prompt ids are given (`tokens`)."""

    tokens: list[int] = Field(..., min_length=1)


class CompletionRequest(SamplingFields):
    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    add_special_tokens: bool = True
    prompt_logprobs: int | None = None  # vLLM's: the prompt's own logprobs (+ the top k), e.g. for a teacher
    # asyncrl's (SGLang's name): prompt_logprobs only from this prompt position on (earlier entries: null), so a
    # teacher scoring a completion does not ship its prompt's top k; vLLM ignores the field
    logprob_start_len: int | None = None

    @field_validator("prompt_logprobs", mode="before")
    @classmethod
    def _prompt_logprobs(cls, v: Any) -> Any:
        if v is not None and (type(v) is not int or not 0 <= v <= MAX_TOP_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {v!r}")
        return v

    @field_validator("logprob_start_len", mode="before")
    @classmethod
    def _logprob_start_len(cls, v: Any) -> Any:
        if v is not None and (type(v) is not int or v < 0):
            raise ValueError(f"logprob_start_len must be a non-negative integer (a prompt position), got {v!r}")
        return v

    @model_validator(mode="after")
    def _checks(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo is not supported")
        if self.stream and self.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs are not available with stream=true; send a non-streaming request")
        if self.logprob_start_len is not None and self.prompt_logprobs is None:
            raise ValueError("logprob_start_len says where prompt_logprobs start: it needs prompt_logprobs")
        if isinstance(self.prompt, list) and len(self.prompt) == 0:
            raise ValueError("prompt must not be empty")
        return self

    def to_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        params = super().to_params(max_tokens, logprobs)
        params.prompt_logprobs = self.prompt_logprobs
        return params

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = Field(None, json_schema_extra=_MESSAGES_DOC)
    tools: list[dict[str, Any]] | None = Field(None, json_schema_extra=_TOOLS_DOC)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        return self


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


class GenerateSamplingParams(SamplingFields):
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)


class GenerateRequest(_Body):
    """/inference/v1/generate: token ids in, token ids (+ logprobs) out."""

    model: str | None = None
    token_ids: list[int] = Field(..., min_length=1)
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    stream: Literal[False] = False


def _no_nul(path: str) -> str:
    """No file path holds a NUL byte (the OS refuses it, pathlib raises): a bad value, not a missing dir."""
    if "\x00" in path:
        raise ValueError("a path must not contain a NUL byte")
    return path


class UpdateWeightsRequest(_Body):
    weight_dir: str = Field(..., min_length=1)

    _path = field_validator("weight_dir")(_no_nul)


class LoadLoraRequest(_Body):
    lora_name: str = Field(..., min_length=1)
    lora_path: str = Field(..., min_length=1)

    _path = field_validator("lora_path")(_no_nul)


class UnloadLoraRequest(_Body):
    lora_name: str = Field(..., min_length=1)


def resolve_max_tokens(requested: int | None, prompt_len: int, max_model_len: int) -> int:
    """Concrete max_tokens; refuses prompts that (with max_tokens) overflow the context, vLLM-style wording."""
    if prompt_len >= max_model_len:
        raise InvalidRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt is "
            f"{prompt_len} tokens, which leaves no room for the completion. Please reduce the length of the input.",
            param="messages",
        )
    if requested is None:
        return max_model_len - prompt_len
    if prompt_len + requested > max_model_len:
        raise InvalidRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the input, {requested} in the completion). "
            "Please reduce the length of the input or of max_tokens.",
            param="max_tokens",
        )
    return requested


def check_message(i: int, m: dict[str, Any]) -> None:
    """One chat message as the OpenAI API takes it: a known role; content a string or a list of parts
    (an assistant turn may leave it out)."""
    role, content = m.get("role"), m.get("content")
    if role not in ROLES:
        raise ValueError(f"messages[{i}].role must be one of {', '.join(ROLES)}; got {role!r}")
    if content is None and role != "assistant":  # an earlier assistant turn may be all reasoning / tool calls
        raise ValueError(f"messages[{i}] ({role}) needs 'content' (a string or a list of content parts)")
    if content is not None and not isinstance(content, str | list):
        raise ValueError(f"messages[{i}].content must be a string or a list of content parts")


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest(f"{param} contains ids outside the vocabulary [0, {vocab_size}): {bad[:5]}", param=param)


def finite_logprob(x: float) -> float:
    """JSON has no -inf: a filtered-out token's logprob is reported as -9999.0 (vLLM's convention)."""
    return x if math.isfinite(x) else -9999.0
