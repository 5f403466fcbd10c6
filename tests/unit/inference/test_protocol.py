"""Request validation of the inference routes and its mapping to SamplingParams."""

import json

import pytest
from pydantic import ValidationError

from asyncrl.inference.api.errors import InvalidRequest
from asyncrl.inference.api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    TokenizeRequest,
    check_token_ids,
    finite_logprob,
    resolve_max_tokens,
)

MSGS = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "patch",
    [
        {"temperature": -0.1},
        {"temperature": float("nan")},
        {"temperature": float("inf")},
        {"top_p": 0.0},
        {"top_p": 1.01},
        {"top_k": -5},
        {"min_p": -0.1},
        {"min_p": 1.5},
        {"n": 0},
        {"max_tokens": 0},
        {"max_completion_tokens": -1},
        {"top_logprobs": 21},
        {"stop": [""]},
        {"presence_penalty": 0.5},
        {"repetition_penalty": 1.2},
        {"min_tokens": 5, "max_tokens": 2},
        {"logit_bias": {"3": 101}},
        {"logit_bias": {"-1": 1}},
        {"logit_bias": {"x": 1}},
        {"messages": []},
        {"messages": [{"content": "no role"}]},
        {"tool_choice": "sometimes"},
    ],
)
def test_chat_request_rejects(patch):
    with pytest.raises(ValidationError):
        ChatCompletionRequest(**{"messages": MSGS, **patch})


def test_chat_request_defaults_and_params():
    req = ChatCompletionRequest(messages=MSGS, max_completion_tokens=7, top_k=0, stop="END", logit_bias={"5": -2})
    assert req.requested_max_tokens() == 7
    params = req.to_params(7, req.logprobs_k())
    assert params.temperature == 1.0 and params.top_p == 1.0 and params.top_k == -1 and params.min_p == 0.0
    assert params.stop == ["END"] and params.logprobs is None and params.logit_bias == {5: -2.0}
    assert not params.greedy and not params.filtered
    req = ChatCompletionRequest(messages=MSGS, logprobs=True, top_logprobs=3, temperature=0, top_p=0.5)
    params = req.to_params(4, req.logprobs_k())
    assert params.logprobs == 3 and params.greedy and params.filtered
    with pytest.raises(InvalidRequest):
        ChatCompletionRequest(messages=MSGS, top_logprobs=2).logprobs_k()


def test_unknown_fields_are_ignored():
    req = ChatCompletionRequest(messages=MSGS, user="me", parallel_tool_calls=True)
    assert req.model_extra == {"user": "me", "parallel_tool_calls": True}


def test_completion_prompts_and_generate_request():
    assert CompletionRequest(prompt="a").prompts() == ["a"]
    assert CompletionRequest(prompt=[1, 2]).prompts() == [[1, 2]]
    assert CompletionRequest(prompt=[[1], [2, 3]]).prompts() == [[1], [2, 3]]
    assert CompletionRequest(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert CompletionRequest(prompt="a").max_tokens == 16  # OpenAI's default for completions
    for bad in ({"prompt": []}, {"prompt": "a", "echo": True}):
        with pytest.raises(ValidationError):
            CompletionRequest(**bad)
    req = GenerateRequest(token_ids=[1, 2], sampling_params={"temperature": 0, "max_tokens": 3, "logprobs": 1})
    assert req.sampling_params.to_params(3, req.sampling_params.logprobs).logprobs == 1
    with pytest.raises(ValidationError):
        GenerateRequest(token_ids=[])
    with pytest.raises(ValidationError):
        TokenizeRequest(prompt="a", messages=MSGS)
    with pytest.raises(ValidationError):
        TokenizeRequest()


def test_resolve_max_tokens_and_context():
    assert resolve_max_tokens(None, 10, 100) == 90
    assert resolve_max_tokens(90, 10, 100) == 90
    with pytest.raises(InvalidRequest, match="maximum context length is 100"):
        resolve_max_tokens(91, 10, 100)
    with pytest.raises(InvalidRequest, match="maximum context length"):
        resolve_max_tokens(None, 100, 100)


def test_token_id_checks():
    check_token_ids([0, 5, 9], 10, "tokens")
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        check_token_ids([3, 10], 10, "tokens")
    with pytest.raises(InvalidRequest):
        ChatCompletionRequest(messages=MSGS, stop_token_ids=[99]).check_vocab(10)
    with pytest.raises(InvalidRequest):
        ChatCompletionRequest(messages=MSGS, logit_bias={"99": 1}).check_vocab(10)
    assert finite_logprob(float("-inf")) == -9999.0 and finite_logprob(-1.5) == -1.5


def test_a_streamed_event_is_one_line_whatever_the_model_wrote():
    from asyncrl.inference.api.completions import sse

    text = "a\u0085b\u2028c\u2029d\ne"  # unicode line separators: str.splitlines (httpx's aiter_lines) cuts there
    event = sse({"choices": [{"delta": {"content": text}}]})
    (line,) = [x for x in event.splitlines() if x]
    assert json.loads(line.removeprefix("data: "))["choices"][0]["delta"]["content"] == text
