"""Direct v1 episodes (`orchestrator/envs/direct.py`) against verifiers' own path: the differential test.

A scripted engine (`GenerateServer`: a real local HTTP server speaking `/inference/v1/generate` and
`/v1/models`) answers the k-th request for a prompt with the k-th of a few replies, so both paths get the
same answers for the same prompts however their requests are grouped. Seeded groups of every shipped
environment (single-turn reverse-text and sort-letters, two-turn echo-twice) and of a two-agent test
environment (`v1_envs/duet_v1`: a standing set in `setup`, an interaction, `finalize`) run through both
paths; each group's training rows (ids, masks, logprobs, reward, metrics, texts, errors) must be the same,
and so must the requests the engine saw (the direct path's n = k request counted k times).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import sys
import threading
import zlib
from collections import Counter
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

vf = pytest.importorskip("verifiers.v1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "integration" / "v1_envs"))

from asyncrl.config.orchestrator import ClientConfig, EnvConfig, SamplingConfig  # noqa: E402
from asyncrl.orchestrator.envs.mixture import EnvMixture, group_inputs  # noqa: E402
from asyncrl.orchestrator.envs.runners import runners_for, sampling_args  # noqa: E402
from asyncrl.orchestrator.samples import TrajectoryConverter  # noqa: E402
from tests.local_http import LocalHTTP  # noqa: E402

KEY_VAR = "ASYNCRL_TEST_DIRECT_KEY"
USER = re.compile(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", re.S)


class GenerateServer(LocalHTTP):
    """Plays the engine: the k-th sample of a prompt is reply k (mod 5) of that prompt (one of them a tool call
    of the question's expression); records requests."""

    def __init__(self, tokenizer, model: str, fail: bool = False):
        self.tokenizer, self.model, self.fail = tokenizer, model, fail
        self.seen: Counter = Counter()
        self.requests: list[dict] = []
        self.lock = threading.Lock()
        super().__init__(self.handler())

    def reply(self, ids: list[int], k: int) -> list[int]:
        users = USER.findall(self.tokenizer.decode(ids))
        words = re.findall(r"[a-z]+", users[0]) if users else []
        word = words[-1] if words else "none"
        asked = re.search(r"What is (.*)\?", users[0]) if users else None
        call = {"name": "calculate", "arguments": {"expression": asked.group(1) if asked else "6 * 7"}}
        options = [word, word[::-1], f"{word} {word}", "no", f"<tool_call>\n{json.dumps(call)}\n</tool_call>"]
        pick = options[(zlib.crc32(json.dumps(ids).encode()) + k) % len(options)]
        return self.tokenizer.encode(pick, add_special_tokens=False) + [self.tokenizer.eos_token_id]

    def answer(self, body: dict) -> dict:
        ids, sp = body["token_ids"], body["sampling_params"]
        with self.lock:
            self.requests.append(body)
            firsts = [self.seen[json.dumps(ids)] + j for j in range(sp.get("n", 1))]
            self.seen[json.dumps(ids)] += len(firsts)
        return {"request_id": "gen-1", "prompt_token_ids": ids, "choices": [self.choice(ids, k) for k in firsts]}

    def choice(self, ids: list[int], k: int) -> dict:
        out = self.reply(ids, k)
        lps = [
            {"token": f"token_id:{t}", "logprob": -0.1 - 0.01 * ((i + k) % 7), "top_logprobs": []}
            for i, t in enumerate(out)
        ]
        return {"index": 0, "token_ids": out, "finish_reason": "stop", "logprobs": {"content": lps}}

    def handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                self.send(200, {"data": [{"id": server.model, "max_model_len": 4096}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                if server.fail:
                    return self.send(503, {"error": {"message": "engine overloaded"}})
                self.send(200, server.answer(body))

            def send(self, status: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        return Handler


@pytest.fixture(scope="module")
def loop():
    """One event loop for the module: the `renderers` package keeps a module-level asyncio lock (its
    max_model_len lookup), bound to the first loop that waits on it."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def run_groups(loop, env_id: str, args: dict, model: Path, server: GenerateServer, direct: bool, groups: int = 3):
    renderer = {"name": "default", "tool_parser": "qwen3"} if env_id == "tool-calc" else None
    """`groups` groups of 4 rollouts of the env's first tasks, as training rows (one list per group)."""
    mixture = EnvMixture.load([EnvConfig(id=env_id, args=args)], seq_len=None)
    slot = mixture.slots[0]
    client = ClientConfig(base_url=server.url, api_key_var=KEY_VAR)
    runners = runners_for(mixture.slots, client, str(model), str(model), renderer=renderer, direct=direct)
    sampling = sampling_args(SamplingConfig(max_tokens=16))

    async def main():
        try:
            return await asyncio.gather(
                *(runners.run_group(slot, group_inputs(slot.rows[i], 4), sampling) for i in range(groups))
            )
        finally:
            await runners.close()

    converter = TrajectoryConverter()
    return runners, [[converter.convert(o, slot.name) for o in outs] for outs in loop.run_until_complete(main())]


def rows(group) -> list[str]:
    """A group's rows in a canonical order (the k-th answer may go to any episode of the group)."""
    return sorted(json.dumps(dataclasses.asdict(r), sort_keys=True) for r in group)


def requests(server: GenerateServer) -> list[str]:
    """The requests the engine saw, an n = k request counted as k requests of n = 1."""
    seen = []
    for body in server.requests:
        sp = dict(body["sampling_params"])
        n = sp.pop("n", 1)
        seen += [json.dumps({**body, "sampling_params": sp}, sort_keys=True)] * n
    return sorted(seen)


ENVS = [
    ("reverse-text", {}),
    ("sort-letters", {}),
    ("echo-twice", {}),
    ("tool-calc", {}),
    ("duet-v1", {}),
    ("reverse-text", {"instructions": "Reverse it."}),  # a system prompt
    ("echo-twice", {"reward": "similarity"}),
]


@pytest.mark.parametrize(("env_id", "args"), ENVS, ids=[f"{e}{'+' if a else ''}" for e, a in ENVS])
def test_direct_episodes_give_verifiers_rows(loop, env_id, args, tiny_model_dir, tokenizer, monkeypatch):
    monkeypatch.setenv(KEY_VAR, "unused")
    results = {}
    for direct in (False, True):
        server = GenerateServer(tokenizer, str(tiny_model_dir))
        try:
            runners, groups = run_groups(loop, env_id, args, tiny_model_dir, server, direct)
        finally:
            server.close()
        went_direct = runners.v1.direct is not None and all(runners.v1.direct.chosen.values())
        assert went_direct == direct
        results[direct] = (groups, requests(server), len(server.requests))
    (full, full_requests, full_sent), (direct, direct_requests, direct_sent) = results[False], results[True]
    assert all(r.ok for g in full for r in g), [r.error for g in full for r in g]
    assert [rows(g) for g in direct] == [rows(g) for g in full]
    assert direct_requests == full_requests
    assert direct_sent < full_sent  # a group's shared prompt went out once
    scores = {json.dumps([r.reward, r.metrics], sort_keys=True) for g in full for r in g}
    assert len(scores) > 1, "the scripted replies should score differently"


def test_an_engine_failure_fails_the_rollouts_as_on_verifiers_path(loop, tiny_model_dir, tokenizer, monkeypatch):
    monkeypatch.setenv(KEY_VAR, "unused")
    errors = {}
    for direct in (False, True):
        server = GenerateServer(tokenizer, str(tiny_model_dir), fail=True)
        try:
            _, groups = run_groups(loop, "reverse-text", {}, tiny_model_dir, server, direct, groups=1)
        finally:
            server.close()
        errors[direct] = {r.error for g in groups for r in g}
    assert len(errors[True]) == 1 and "503" in next(iter(errors[True])), errors
    assert all("503" in e for e in errors[False]), errors


def test_other_harnesses_and_runtimes_keep_verifiers_path():
    from asyncrl.orchestrator.envs.direct import env_direct_reason
    from asyncrl.orchestrator.envs.v1 import load_v1_env

    assert env_direct_reason(load_v1_env("tool_calc", "tool-calc", {})) is None
    other = load_v1_env("reverse_text", "reverse-text", {"agent": {"harness": {"id": "null"}}})
    assert env_direct_reason(other) == "agent 'agent' runs harness 'null'"
    assert env_direct_reason(load_v1_env("reverse_text", "reverse-text", {})) is None


def test_the_library_internals_direct_episodes_use_are_as_they_were():
    """Tripwire: `envs.direct` and `envs.sampler` use these private parts of verifiers 0.4.0 and renderers 0.1.12
    (see their docstrings). A change to any of them fails here, before an episode records something else."""
    import inspect

    from renderers import client as renderers_client
    from verifiers.v1.agent import Agent, Agents, Interaction, _EpisodeAgent
    from verifiers.v1.clients.train import _is_valid_incremental_tail
    from verifiers.v1.env import Env

    def params(fn):
        return list(inspect.signature(fn).parameters)

    assert params(Env._episode_agents) == ["self", "ctx", "completed", "on_trace", "on_discard"]
    assert "self._agents" in inspect.getsource(Agents.__init__)
    assert params(Agent._run_once) == ["self", "task", "runtime", "shared_tools", "on_trace", "collect_artifacts"]
    made = inspect.getsource(Agent._rollout_params)
    assert all(f'"{key}"' in made for key in ("harness", "runtime_config", "timeouts", "limits"))
    assert params(Interaction.__init__) == ["self", "run", "gate"]
    assert _EpisodeAgent.__mro__[1] is Agent and "super().interaction(" in inspect.getsource(_EpisodeAgent)
    assert params(renderers_client._parse_completion_logprobs) == ["choice", "completion_ids"]
    assert params(_is_valid_incremental_tail) == ["messages"]
    body = inspect.getsource(renderers_client.generate)  # what envs.sampler.request_body builds the same way
    for line in ('sp["stop_token_ids"] = stop_token_ids', 'sp["logprobs"] = 1', '"token_ids": prompt_ids'):
        assert line in body, line
