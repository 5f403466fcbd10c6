"""Generated hostile input against the inference server, every backend in BACKENDS, over real HTTP.

schemathesis reads the server's own /openapi.json (the embedded app's routes, or vLLM's app with our
routes mounted on it, as it is) and each operation of our API (OUR_ROUTES: the embedded server's, which vLLM's
app also serves) gets EXAMPLES requests that fit its schema and EXAMPLES that do not (wrong types,
out-of-range values, missing fields), all with the api key; vLLM's own routes beyond ours (its Responses and
Anthropic APIs, renderers, batch chat) get VLLM_ONLY_EXAMPLES of each: drawing bodies from their large schemas
was two thirds of the test's CPU (a /v1/chat/completions/batch body ~0.5 CPU s).
Every answer must be no 5xx and every 4xx the one error body; afterwards the server must answer
/health and give the same greedy completion as before (its weights untouched). The server is the
session's shared one (`shared_server`, tests/conftest.py, also used by the inference contract); its
`--allowed-weights-root` is this session's pytest temp dir, which no generated path names, so every dir
the weight routes are given here is refused;
/reload_weights is left out (it changes nothing here, and takes no input). `regressions` are inputs
that once broke a backend, sent as they are.

Each backend's counts by status code are printed (the figures in docs/reliability.md): run with `-s`.
"""

from __future__ import annotations

import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))  # server_proc
from server_proc import AUTH, client  # noqa: E402

from asyncrl.inference.api.errors import error_type  # noqa: E402

pytestmark = [pytest.mark.reliability, pytest.mark.slow]

EXAMPLES = 30  # per operation and mode (valid, invalid) on the routes of our API
VLLM_ONLY_EXAMPLES = 10  # on vLLM's routes beyond ours
OUR_ROUTES = {
    "/detokenize", "/health", "/inference/v1/generate", "/load_lora_adapter", "/reload_weights", "/tokenize",
    "/unload_lora_adapter", "/update_weights", "/v1/chat/completions", "/v1/chat/completions/tokens",
    "/v1/completions", "/v1/models",
}  # fmt: skip
SEED = 15  # the same requests every run
EXCLUDED = {"/reload_weights"}
# Generation lengths a valid request may ask for are capped, so the time goes into many requests
# rather than long replies (a long reply to a valid request is no hostile input).
CAPS = {"max_tokens": 4, "max_completion_tokens": 4, "max_output_tokens": 4, "n": 2, "best_of": 2}
PROMPT = [1, 2, 3, 4, 5]
TALLY: dict[str, Counter] = defaultdict(Counter)  # backend -> status code (or "no answer") -> requests


# ---- the server --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def allowed_root(served_weights_root) -> Path:
    return served_weights_root  # the server's --allowed-weights-root (tests/conftest.py)


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server  # tests/conftest.py: one per backend for the session, shared with the contract suite


@pytest.fixture(scope="module")
def http(server):
    with client(server) as c:
        yield c


@pytest.fixture(scope="module")
def greedy_before(http, server):
    return greedy(http, server)


def greedy(http: httpx.Client, server) -> tuple[str, list[float]]:
    """A fixed prompt's greedy completion and its logprobs: what the served weights say."""
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 0}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["text"], choice["logprobs"]["token_logprobs"]


# ---- what every answer must be ----------------------------------------------------------------------------


def error_body_problem(status: int, body) -> str | None:
    """What is wrong with a 4xx body, if anything: it must be {"error": {"message", "type", "param", "code"}}."""
    error = body.get("error") if isinstance(body, dict) and set(body) == {"error"} else None
    if not isinstance(error, dict) or set(error) != {"message", "type", "param", "code"}:
        return f"not the one error body: {body!r:.300}"
    if not isinstance(error["message"], str) or not error["message"]:
        return "no message"
    if not (error["param"] is None or isinstance(error["param"], str)):
        return f"param {error['param']!r} is no string"
    if (error["code"], error["type"]) != (status, error_type(status)):
        return f"code/type {error['code']!r}/{error['type']!r} for a {status}"
    return None


def answer_problem(status: int, content: bytes) -> str | None:
    """What is wrong with an answer, if anything: a 5xx, or a 4xx without the one error body."""
    if status >= 500:
        return f"server error {status}: {content[:300]!r}"
    if 400 <= status < 500:
        try:
            body = json.loads(content)
        except ValueError:
            return f"{status} without a JSON body: {content[:300]!r}"
        return error_body_problem(status, body)
    return None


# ---- the generated suite -------------------------------------------------------------------------------


def capped(body):
    """`body` with valid but long generation lengths (CAPS) lowered, at any depth; other values untouched."""
    if isinstance(body, list):
        return [capped(x) for x in body]
    if not isinstance(body, dict):
        return body
    out = {k: capped(v) for k, v in body.items()}
    for key, cap in CAPS.items():
        if type(out.get(key)) is int and out[key] > cap:
            out[key] = cap
    return out


def cases(operation) -> st.SearchStrategy:
    """Requests that fit `operation`'s schema, and ones that do not where it has inputs to get wrong."""
    modes = [GenerationMode.POSITIVE]
    if operation.body or operation.query or operation.path_parameters:
        modes.append(GenerationMode.NEGATIVE)
    return st.one_of(*[operation.as_strategy(generation_mode=mode) for mode in modes])


def fuzz(operation, backend: str, session: requests.Session, failures: list[str]) -> None:
    """Send `operation` its generated requests; what is wrong with an answer goes to `failures`."""
    examples = EXAMPLES if operation.path in OUR_ROUTES else VLLM_ONLY_EXAMPLES

    @settings(max_examples=2 * examples, database=None, deadline=None, phases=[Phase.explicit, Phase.generate],
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @seed(SEED)
    @given(case=cases(operation))
    def send(case) -> None:
        case.body = capped(case.body)
        try:
            response = case.call(session=session, headers=AUTH, timeout=120)
        except requests.RequestException as e:
            TALLY[backend]["no answer"] += 1
            failures.append(f"{operation.label}: no answer ({e})\n    {case.as_curl_command()}")
            return
        TALLY[backend][response.status_code] += 1
        problem = answer_problem(response.status_code, response.content)
        if problem is not None:
            failures.append(f"{operation.label}: {problem}\n    {case.as_curl_command()}")

    send()


def load_schema(base_url: str):
    """The server's OpenAPI schema; failures print whole requests (schemathesis hides token-like fields)."""
    config = schemathesis.Config.from_dict({"output": {"sanitization": {"enabled": False}}})
    return schemathesis.openapi.from_url(f"{base_url}/openapi.json", config=config, headers=AUTH, timeout=60)


def test_generated_requests(server, greedy_before):
    schema = load_schema(server.base_url)
    operations = [result.ok() for result in schema.get_all_operations()]
    if server.backend == "embedded":  # our API is the embedded server's: OUR_ROUTES must follow it
        assert {op.path for op in operations} == OUR_ROUTES, "the embedded server's routes changed: update OUR_ROUTES"
    failures: list[str] = []
    with requests.Session() as session:
        for operation in operations:
            if operation.path not in EXCLUDED:
                fuzz(operation, server.backend, session, failures)
    kinds = Counter(f.split("\n")[0][:120] for f in failures)
    summary = "\n".join(f"{n} x {kind}" for kind, n in kinds.most_common())
    assert not failures, f"{len(failures)} bad answers:\n{summary}\n\nfirst ones:\n" + "\n".join(failures[:10])


# ---- inputs that once broke a backend ------------------------------------------------------------------


def regressions(allowed_root: Path) -> list[tuple[str, str, dict | None]]:
    """(method, path, JSON body) of requests that once got a 5xx, or an error body of another type."""
    too_long = str(allowed_root / ("a" * 300))  # inside the allowed root, but no name may be that long
    assistant = {"id": "m", "role": "assistant", "status": "completed", "type": "message"}
    user = {"role": "user", "content": "x"}
    return [
        ("POST", "/load_lora_adapter", {"lora_name": "a", "lora_path": "x\x00y"}),  # pathlib: embedded null byte
        ("POST", "/update_weights", {"weight_dir": "x\x00y"}),
        ("POST", "/load_lora_adapter", {"lora_name": "a", "lora_path": too_long}),  # OSError: name too long
        ("POST", "/update_weights", {"weight_dir": too_long}),
        ("POST", "/tokenize", {"messages": [user], "add_special_tokens": True}),  # transformers 5: AttributeError
        # vLLM only (the embedded server answers 404 or ignores the field):
        ("POST", "/inference/v1/generate",  # vLLM: AssertionError, an empty 500
         {"token_ids": [1, 0], "sampling_params": {"max_tokens": 4, "trace_decode_token_ids": []}}),
        ("POST", "/v1/responses/render", {"input": [{**assistant, "content": []}, user]}),  # IndexError
        ("POST", "/v1/responses", {"input": [{**assistant, "content": [{"type": "refusal", "refusal": "no"}]}, user],
                                   "max_output_tokens": 4}),  # AttributeError
        ("POST", "/v1/systemone", {"questions": {}, "state": None}),  # 501 for a model without that API
        ("GET", "/v1/responses/0", None),  # 404 typed invalid_request_error
        ("POST", "/v1/messages", {"model": "nope", "max_tokens": 4, "messages": [user]}),  # Anthropic's error shape
        ("POST", "/v1/responses/0/cancel", None),
    ]  # fmt: skip


def test_regressions(server, http, allowed_root):
    for method, path, body in regressions(allowed_root):
        r = http.request(method, path, json=body)
        assert answer_problem(r.status_code, r.content) is None, (path, body, r.status_code, r.text)


# ---- afterwards --------------------------------------------------------------------------------------------


def test_server_intact_afterwards(server, http, greedy_before, capsys):
    assert httpx.get(f"{server.base_url}/health", timeout=30).status_code == 200
    text, logprobs = greedy(http, server)
    assert text == greedy_before[0]
    assert logprobs == pytest.approx(greedy_before[1], abs=1e-4)
    counts = TALLY[server.backend]
    with capsys.disabled():
        by_status = ", ".join(f"{status}: {n}" for status, n in sorted(counts.items(), key=lambda kv: str(kv[0])))
        print(f"\n[hostile] {server.backend}: {sum(counts.values())} generated requests ({by_status})")
