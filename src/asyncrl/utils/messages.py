"""Chat messages and tool definitions as the plain OpenAI dicts a chat template renders.

Datasets and verifiers hold them in looser forms: a string for a one-message turn, None for absent
fields (Arrow fills them when rows differ), tool calls as OpenAI dicts, verifiers' flat
`{id, name, arguments}` or JSON strings of either, tools as flat `{name, description, parameters}`
or `Tool` objects. Both functions are pure: the input is never modified, and already-OpenAI input
comes back equal.
"""

from __future__ import annotations

import json
from typing import Any


def _drop_none(value: Any) -> Any:
    """Recursively drop None values: Arrow fills absent struct fields with None when rows differ."""
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_none(v) for v in value]
    return value


def _tool_call(call: Any) -> dict:
    if isinstance(call, str):
        call = json.loads(call)
    call = _drop_none(call)
    if "function" in call:
        return {"type": "function", **call}
    function = {"name": call.get("name"), "arguments": call.get("arguments", "{}")}
    out = {"type": "function", "function": function}
    if "id" in call:
        out["id"] = call["id"]
    return out


def openai_messages(messages: Any, default_role: str) -> list[dict]:
    """Chat messages as plain dicts the chat template can render (a string becomes one message)."""
    if isinstance(messages, str):
        return [{"role": default_role, "content": messages}]
    if not isinstance(messages, list):
        raise ValueError(f"expected a list of chat messages or a string, got {type(messages).__name__}")
    out = []
    for m in messages:
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(f"every message needs a 'role', got {m!r:.100}")
        msg = {k: v for k, v in m.items() if v is not None and k != "tool_calls"}
        msg["role"] = m["role"]
        msg.setdefault("content", "")
        if m.get("tool_calls"):
            msg["tool_calls"] = [_tool_call(c) for c in m["tool_calls"]]
        out.append(_drop_none(msg))
    return out


def openai_tools(tools: Any) -> list[dict] | None:
    """Tool definitions in OpenAI form; verifiers' flat `{name, description, parameters}` is wrapped."""
    if not tools:
        return None
    out = []
    for tool in tools:
        if hasattr(tool, "model_dump"):  # verifiers' Tool objects
            tool = tool.model_dump()
        tool = _drop_none(json.loads(tool) if isinstance(tool, str) else tool)
        out.append(tool if "function" in tool else {"type": "function", "function": tool})
    return out
