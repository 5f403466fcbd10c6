"""Chat templating and output parsing (hermes tool calls, <think> reasoning), whole and streamed."""

import json
import random

import pytest

from asyncrl.inference.api.chat import (
    ChatOutputParser,
    TemplateError,
    parse_hermes_tool_calls,
    render_chat,
    split_reasoning,
)


def test_split_reasoning_rules():
    assert split_reasoning("<think>a b</think>\n\nanswer", "qwen3") == ("a b", "\n\nanswer")
    assert split_reasoning("a b</think>answer", "qwen3") == ("a b", "answer")  # <think> was in the prompt
    assert split_reasoning("just an answer", "qwen3") == (None, "just an answer")
    assert split_reasoning("<think>cut off", "qwen3") == ("cut off", "")  # truncated while thinking
    assert split_reasoning("still thinking", "deepseek_r1") == ("still thinking", "")
    assert split_reasoning("<think>x</think>y", "deepseek_r1") == ("x", "y")
    assert split_reasoning("<think>x</think>y", None) == (None, "<think>x</think>y")


def test_hermes_tool_calls():
    text = 'Let me check.<tool_call>\n{"name": "get", "arguments": {"city": "Paris"}}\n</tool_call>'
    content, calls = parse_hermes_tool_calls(text)
    assert content == "Let me check."
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("chatcmpl-tool-")
    assert calls[0]["function"]["name"] == "get"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}

    two = (
        '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n'
        '<tool_call>{"name": "b", "arguments": {"x": [1]}}</tool_call>'
    )
    content, calls = parse_hermes_tool_calls(two)
    assert content is None and [c["function"]["name"] for c in calls] == ["a", "b"]
    assert len({c["id"] for c in calls}) == 2

    # an unclosed final block (max_tokens hit right after the JSON) still parses
    content, calls = parse_hermes_tool_calls('<tool_call>{"name": "a", "arguments": {"k": "v"}}')
    assert calls[0]["function"]["arguments"] == '{"k": "v"}'

    # anything unparsable: no calls, the text stays content
    for bad in ['<tool_call>{"name": "a", "arguments": {</tool_call>', "<tool_call>[1, 2]</tool_call>",
                '<tool_call>{"arguments": {}}</tool_call>']:  # fmt: skip
        assert parse_hermes_tool_calls(bad) == (bad, [])
    assert parse_hermes_tool_calls("no calls") == ("no calls", [])


def test_string_arguments_kept_verbatim():
    _, calls = parse_hermes_tool_calls('<tool_call>{"name": "a", "arguments": "{\\"q\\": 1}"}</tool_call>')
    assert calls[0]["function"]["arguments"] == '{"q": 1}'


def test_final_message_fields():
    msg = ChatOutputParser("qwen3", True).final(
        '<think>hmm</think>hi<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    )
    assert msg["reasoning_content"] == "hmm" and msg["content"] == "hi" and len(msg["tool_calls"]) == 1
    msg = ChatOutputParser(None, False).final("<tool_call>x</tool_call>")
    assert msg == {"role": "assistant", "content": "<tool_call>x</tool_call>"}
    msg = ChatOutputParser(None, True).final('<tool_call>{"name": "f", "arguments": {}}</tool_call>')
    assert msg["content"] is None and msg["tool_calls"][0]["function"]["name"] == "f"


TEXTS = [
    '<think>let me see</think>The answer is 4.<tool_call>{"name": "calc", "arguments": {"e": "2+2"}}</tool_call>',
    "plain answer with a < sign and <b>tags</b>",
    "<think>unfinished reasoning",
    "reasoning without open tag</think>then content",
    '<tool_call>{"name": "f", "arguments": {}}</tool_call>',
    "text <tool_call>{broken json</tool_call> more",
    "<thin>not a tag",
]


@pytest.mark.parametrize("reasoning", [None, "qwen3", "deepseek_r1"])
@pytest.mark.parametrize("tools", [False, True])
@pytest.mark.parametrize("text", TEXTS)
def test_streaming_deltas_reassemble_to_final(text, tools, reasoning):
    """However the text is chunked, the streamed reasoning/content/tool calls equal the whole parse."""
    final = ChatOutputParser(reasoning, tools).final(text)
    rng = random.Random(hash((text, tools, reasoning)) % 1000)
    for _ in range(5):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        parser = ChatOutputParser(reasoning, tools)
        got = {"reasoning_content": "", "content": ""}
        for piece in pieces:
            for key, value in parser.delta(piece).items():
                got[key] += value
        end = parser.finish()
        got["reasoning_content"] += end.get("reasoning_content", "")
        got["content"] += end.get("content", "")
        if reasoning == "qwen3" and "</think>" in text and not text.startswith("<think>"):
            continue  # known ambiguity: streamed as content before the late </think> shows up
        assert got["content"] == (final["content"] or "")
        assert got["reasoning_content"] == (final.get("reasoning_content") or "")
        names = [c["function"]["name"] for c in end.get("tool_calls", [])]
        assert names == [c["function"]["name"] for c in final.get("tool_calls", [])]


def test_streaming_never_shows_a_partial_tag():
    parser = ChatOutputParser("qwen3", True)
    shown = ""
    for ch in '<think>ab</think>cd<tool_call>{"name": "f", "arguments": {}}</tool_call>':
        delta = parser.delta(ch)
        shown += delta.get("content", "")
        assert "<" not in delta.get("content", "") and "<" not in delta.get("reasoning_content", "")
    assert shown == "cd"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_render_chat_matches_template(tokenizer):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    ids = render_chat(tokenizer, msgs)
    expected = tokenizer.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}], add_generation_prompt=True,
        tokenize=False,
    )  # fmt: skip
    assert ids == tokenizer.encode(expected, add_special_tokens=False)
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
    no_gen = render_chat(tokenizer, msgs, add_generation_prompt=False)
    assert ids[: len(no_gen)] == no_gen and len(no_gen) < len(ids)


def test_render_chat_tools_and_tool_call_arguments(tokenizer):
    tools = [{"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}]
    call = {"id": "c1", "type": "function", "function": {"name": "get", "arguments": '{"city": "Paris"}'}}
    msgs = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    text = tokenizer.decode(render_chat(tokenizer, msgs, tools))
    assert '"name": "get"' in text and "<tools>" in text
    assert '{"name": "get", "arguments": {"city": "Paris"}}' in text  # JSON-string arguments became an object
    assert "<tool_response>\nsunny\n</tool_response>" in text


def test_render_chat_errors(tokenizer):
    with pytest.raises(TemplateError):
        render_chat(tokenizer, [])
    with pytest.raises(TemplateError, match="image_url"):
        render_chat(tokenizer, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


def test_render_chat_reuses_the_ids_of_identical_requests():
    """The rollouts of one group send the same messages: rendered once; other messages, flags or
    another tokenizer are rendered anew, and callers get their own list."""
    from asyncrl.inference.api.chat import render_chat

    class Tok:
        chat_template = "x"

        def __init__(self, offset):
            self.offset, self.calls = offset, 0

        def apply_chat_template(self, messages, add_generation_prompt, **kw):
            self.calls += 1
            return "".join(m["content"] for m in messages) + ("!" if add_generation_prompt else "")

        def encode(self, text, add_special_tokens):
            return [ord(c) + self.offset for c in text]

    a, b = Tok(0), Tok(1)
    msgs = [{"role": "user", "content": "hi"}]
    first = render_chat(a, msgs)
    first.append(0)
    assert render_chat(a, [dict(m) for m in msgs]) == [104, 105, 33] and a.calls == 1
    assert render_chat(a, msgs, add_generation_prompt=False) == [104, 105] and a.calls == 2
    assert render_chat(a, [{"role": "user", "content": "ho"}]) == [104, 111, 33] and a.calls == 3
    assert render_chat(b, msgs) == [105, 106, 34] and b.calls == 1
