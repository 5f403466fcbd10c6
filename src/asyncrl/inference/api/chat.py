"""Chat prompts and chat outputs: templating messages to token ids, parsing tool calls and reasoning.

- `render_chat`: OpenAI messages (+ tools) through the tokenizer's chat template, like vLLM does
  (assistant tool-call arguments given as JSON strings are parsed to objects for the template).
- `chat_ids`: a route's way to it, awaited; a request's own template goes to the template pool instead.
- `parse_hermes_tool_calls`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks.
- `split_reasoning`: `<think>...</think>` into (reasoning, content), qwen3 or deepseek_r1 rules.
- `StreamingChatParser`: the same two parses incrementally, for SSE deltas.

Messages that cannot be rendered raise `TemplateError`, an `InvalidRequest` (400) on `messages`.
`render_chat` keeps the token ids of recently rendered requests (the rollouts of one RL group send
the same messages together), keyed by the tokenizer and the request's canonical JSON.
"""

from __future__ import annotations

import json
import re
import uuid
import weakref
from collections import OrderedDict
from typing import Any

from asyncrl.inference.api import cpu, template_sandbox
from asyncrl.inference.api.errors import InvalidRequest
from asyncrl.inference.api.template_sandbox import RequestTemplateError, refuse_untrusted

THINK_START, THINK_END = "<think>", "</think>"
TOOL_START, TOOL_END = "<tool_call>", "</tool_call>"
_RENDERED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {request JSON: ids}, LRU first
_RENDERED_MAX = 1024  # per tokenizer
_MAX_TOKEN_CHARS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> max_token_chars
_TOOL_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)$", re.DOTALL)


class TemplateError(InvalidRequest):
    """The messages cannot be rendered (bad roles/content for this template): a 400 on `messages`."""

    def __init__(self, message: str):
        super().__init__(message, param="messages")


def _text_content(content: Any) -> Any:
    """Join OpenAI content parts of type text; other part types are refused."""
    if not isinstance(content, list):
        return content
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise TemplateError(f"content part type '{kind}' is not supported (text only)")
        texts.append(part.get("text", ""))
    return "".join(texts)


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for msg in messages:
        msg = dict(msg)
        if "content" in msg:
            msg["content"] = _text_content(msg["content"])
        calls = msg.get("tool_calls")
        if calls:
            fixed = []
            for call in calls:
                call = dict(call)
                fn = dict(call.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except ValueError:
                        pass  # leave malformed arguments as the model wrote them
                call["function"] = fn
                fixed.append(call)
            msg["tool_calls"] = fixed
        out.append(msg)
    return out


async def chat_ids(
    tokenizer,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool,
    continue_final_message: bool,
    chat_template_kwargs: dict[str, Any] | None,
    trust_request_template: bool,
    max_model_len: int | None,
) -> list[int]:
    """A chat request's prompt token ids, for a route: the served model's template through `render_chat` on the
    CPU thread (cpu.py). A request's own template (`chat_template_kwargs["chat_template"]`) is refused unless
    `trust_request_template`; it renders in the template pool (template_sandbox.py), off the CPU thread, and only
    its text is encoded there: no other request waits while it runs."""
    kwargs = dict(chat_template_kwargs or {})
    template = kwargs.pop("chat_template", None)
    if template is None:
        args = (messages, tools, add_generation_prompt, continue_final_message, chat_template_kwargs, max_model_len)
        return await cpu.run(render_chat, tokenizer, *args)
    if not trust_request_template:
        refuse_untrusted()
    generation = add_generation_prompt and not continue_final_message
    args = (messages, tools, generation, continue_final_message, template, kwargs)
    job = await cpu.run(_template_job, tokenizer, *args)
    text = await template_sandbox.pool().render(job)
    return await cpu.run(_encode, tokenizer, text, max_model_len)


def render_chat(
    tokenizer,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: dict[str, Any] | None = None,
    max_model_len: int | None = None,
) -> list[int]:
    """Token ids of `messages` rendered with the tokenizer's own chat template (cached, see module docstring).

    With `max_model_len`, a rendered text too long for it is refused before it is encoded (`check_fits`).
    Blocking: routes call it through `chat_ids`, which sends a request's own template elsewhere."""
    assert (chat_template_kwargs or {}).get("chat_template") is None, "request templates go through chat_ids"
    args = (messages, tools, add_generation_prompt, continue_final_message, chat_template_kwargs)
    try:
        key = json.dumps(args, sort_keys=True, ensure_ascii=False)
        cache = _RENDERED.setdefault(tokenizer, OrderedDict())
    except (TypeError, ValueError):  # not JSON (the template will say what is wrong), or no weakref
        return _render(tokenizer, *args, max_model_len)
    ids = cache.get(key)
    if ids is None:
        ids = cache[key] = _render(tokenizer, *args, max_model_len)
        if len(cache) > _RENDERED_MAX:
            cache.popitem(last=False)
    cache.move_to_end(key)
    return list(ids)


def _render(
    tokenizer,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool,
    continue_final_message: bool,
    chat_template_kwargs: dict[str, Any] | None,
    max_model_len: int | None,
) -> list[int]:
    text = _render_text(tokenizer, messages, tools, add_generation_prompt, continue_final_message, chat_template_kwargs)
    return _encode(tokenizer, text, max_model_len)


def _encode(tokenizer, text: str, max_model_len: int | None) -> list[int]:
    if max_model_len is not None:
        check_fits(tokenizer, text, max_model_len, "messages")
    return tokenizer.encode(text, add_special_tokens=False)


def _check_renderable(tokenizer, messages: list[dict[str, Any]]) -> None:
    if not messages:
        raise TemplateError("messages must not be empty")
    if getattr(tokenizer, "chat_template", None) is None:
        raise TemplateError("the served model's tokenizer has no chat template; use /v1/completions")


def _render_text(
    tokenizer,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool,
    continue_final_message: bool,
    chat_template_kwargs: dict[str, Any] | None,
) -> str:
    _check_renderable(tokenizer, messages)
    try:
        return tokenizer.apply_chat_template(
            normalize_messages(messages),
            tools=tools or None,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message,
            tokenize=False,
            **(chat_template_kwargs or {}),
        )
    except TemplateError:
        raise
    except Exception as e:  # jinja errors, raise_exception() in templates, bad message shapes
        raise TemplateError(f"cannot apply the chat template to these messages: {e}") from e


def max_token_chars(tokenizer) -> int:
    """The most characters one token stands for: its vocabulary's longest token string (per tokenizer, cached)."""
    n = _MAX_TOKEN_CHARS.get(tokenizer)
    if n is None:
        tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        n = _MAX_TOKEN_CHARS[tokenizer] = max((len(t) for t in tokens if t), default=1)
    return n


def check_fits(tokenizer, text: str, max_model_len: int, param: str) -> None:
    """Refuse `text` that cannot fit the context, before encoding it (megabytes take seconds): it encodes to at
    least len(text) / `max_token_chars` tokens (a token's string has a character per byte or per character)."""
    least = len(text) // max_token_chars(tokenizer)
    if least >= max_model_len:
        raise InvalidRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt is at least "
            f"{least} tokens ({len(text)} characters), which leaves no room for the completion. "
            "Please reduce the length of the input.",
            param=param,
        )


def _template_job(
    tokenizer,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool,
    continue_final_message: bool,
    template: Any,
    kwargs: dict[str, Any],
) -> dict[str, Any]:
    """What the template pool renders for a request's own template (blocking: through `cpu.run`)."""
    _check_renderable(tokenizer, messages)
    if not isinstance(template, str):
        raise RequestTemplateError("chat_template must be a string")
    return {
        "messages": normalize_messages(messages),
        "tools": tools or None,
        "chat_template": template,
        "add_generation_prompt": add_generation_prompt,
        "continue_final_message": continue_final_message,
        "template_kwargs": {**tokenizer.special_tokens_map, **kwargs},
    }


def request_template_kwargs(body: Any) -> dict[str, Any] | None:
    """A chat request's `chat_template_kwargs`, with its top-level `chat_template` (vLLM's field) put in."""
    kwargs = body.chat_template_kwargs
    top = (body.model_extra or {}).get("chat_template")
    if top is None:
        return kwargs
    return {**(kwargs or {}), "chat_template": top}


def split_reasoning(text: str, parser: str | None) -> tuple[str | None, str]:
    """(reasoning, content). Text up to </think> is reasoning (minus a leading <think>). Without
    </think>: qwen3 -> reasoning only if the text opened <think> (cut off while thinking), else all
    content; deepseek_r1 -> all reasoning (its template opens <think> in the prompt)."""
    if parser is None:
        return None, text
    end = text.find(THINK_END)
    if end < 0:
        if parser == "deepseek_r1" or text.startswith(THINK_START):
            return text.removeprefix(THINK_START), ""
        return None, text
    reasoning = text[:end]
    start = reasoning.find(THINK_START)
    if start >= 0:
        reasoning = reasoning[start + len(THINK_START) :]
    return reasoning, text[end + len(THINK_END) :]


def _tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"


def parse_hermes_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content before the first call or None, OpenAI tool_calls). Any unparsable block -> no calls."""
    if TOOL_START not in text:
        return text, []
    calls = []
    for match in _TOOL_BLOCK.finditer(text):
        body = (match.group(1) if match.group(1) is not None else match.group(2)).strip()
        try:
            obj = json.loads(body)
            name, args = obj["name"], obj.get("arguments", {})
            if not isinstance(name, str):
                raise TypeError("name must be a string")
        except (ValueError, KeyError, TypeError):
            return text, []
        arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        calls.append({"id": _tool_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}})
    content = text[: text.find(TOOL_START)]
    return (content if content.strip() else None), calls


class ChatOutputParser:
    """Turns one choice's generated text into message fields, whole or as streaming deltas."""

    def __init__(self, reasoning_parser: str | None, parse_tools: bool):
        self.reasoning_parser = reasoning_parser
        self.parse_tools = parse_tools
        self.text = ""
        self._sent_reasoning = 0
        self._sent_content = 0

    def final(self, text: str) -> dict[str, Any]:
        """Message fields for the complete text: content, reasoning_content, tool_calls."""
        reasoning, content = split_reasoning(text, self.reasoning_parser)
        tool_calls: list[dict[str, Any]] = []
        if self.parse_tools:
            content, tool_calls = parse_hermes_tool_calls(content)
        msg: dict[str, Any] = {"role": "assistant", "content": content if (content or not tool_calls) else None}
        if reasoning is not None:
            msg["reasoning_content"] = reasoning
        if tool_calls:
            msg["tool_calls"] = tool_calls
        return msg

    def delta(self, new_text: str) -> dict[str, str]:
        """Streaming: the reasoning/content text that can be shown after `new_text` arrived.

        Text that may be the start of a tag is held back until it is known; content after a
        <tool_call> is withheld (the calls are sent whole by `finish`).
        """
        self.text += new_text
        reasoning, content = self._split_partial(self.text)
        out: dict[str, str] = {}
        if reasoning is not None and len(reasoning) > self._sent_reasoning:
            out["reasoning_content"] = reasoning[self._sent_reasoning :]
            self._sent_reasoning = len(reasoning)
        if len(content) > self._sent_content:
            out["content"] = content[self._sent_content :]
            self._sent_content = len(content)
        return out

    def finish(self) -> dict[str, Any]:
        """Streaming: what is left at the end — unsent text and the tool calls."""
        final = self.final(self.text)
        out: dict[str, Any] = {}
        reasoning = final.get("reasoning_content")
        if reasoning is not None and len(reasoning) > self._sent_reasoning:
            out["reasoning_content"] = reasoning[self._sent_reasoning :]
        content = final.get("content") or ""
        if len(content) > self._sent_content:
            out["content"] = content[self._sent_content :]
        if final.get("tool_calls"):
            out["tool_calls"] = [dict(c, index=i) for i, c in enumerate(final["tool_calls"])]
        return out

    def _split_partial(self, text: str) -> tuple[str | None, str]:
        reasoning: str | None = None
        content = text
        if self.reasoning_parser is not None:
            if THINK_END in text:
                reasoning, content = split_reasoning(text, self.reasoning_parser)
            elif _is_prefix(text, THINK_START):
                return None, ""  # may still become <think>
            elif self.reasoning_parser == "deepseek_r1" or text.startswith(THINK_START):
                return _hold(text.removeprefix(THINK_START), THINK_END), ""  # still thinking
        if self.parse_tools:
            at = content.find(TOOL_START)
            content = content[:at] if at >= 0 else _hold(content, TOOL_START)
        return reasoning, content


def _is_prefix(text: str, tag: str) -> bool:
    return len(text) < len(tag) and tag.startswith(text)  # "" counts: nothing is known yet


def _hold(text: str, tag: str) -> str:
    """`text` minus a trailing partial `tag` (which might complete with the next delta)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return text[:-k]
    return text
