"""verifiers v1 against our server (issue 27, first brick): an episode of a v1 taskset runs through verifiers'
own training client (renderers' `generate` -> our `/inference/v1/generate`), and the token ids and logprobs
on its trace are the ones the embedded engine sampled: the HF forward of the same ids gives the same logprobs.

The taskset is `v1_envs/reverse_v1` (local tasks). Harness `null`, runtime `subprocess`: the model is called
from this process, no sandbox.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow
sys.path.insert(0, str(Path(__file__).resolve().parent / "v1_envs"))
vf = pytest.importorskip("verifiers.v1")


def run_episode(server, task_index: int, max_tokens: int = 8):
    from verifiers.v1.envs.single_agent import SingleAgentEnvConfig
    from verifiers.v1.utils.loaders import load_environment

    config = SingleAgentEnvConfig.model_validate(
        {"taskset": {"id": "reverse_v1"}, "agent": {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}}}
    )
    env = load_environment(config)
    task = list(env.taskset)[task_index]
    client = vf.TrainClientConfig(
        base_url=server.url, api_key_var="ASYNCRL_TEST_V1_KEY", renderer_model_name=server.model
    )
    sampling = vf.Sampling(max_tokens=max_tokens, temperature=1.0)
    ctx = vf.ModelContext(model=server.model, client=client, sampling=sampling)
    return task, asyncio.run(env.run_episode(task, ctx))


def test_a_v1_episode_carries_the_engines_tokens_and_logprobs(shared_inference_process, monkeypatch):
    monkeypatch.setenv("ASYNCRL_TEST_V1_KEY", "unused")  # the server has no key; the client wants a variable
    task, episode = run_episode(shared_inference_process, 1)
    assert episode.ok and not episode.errors, episode.errors
    (trace,) = episode.traces
    assert trace.reward in (0.0, 1.0) and trace.num_turns == 1
    (branch,) = trace.branches
    ids, logprobs, sampled = branch.token_ids, branch.logprobs, branch.sampled_mask
    assert len(ids) == len(logprobs) == len(sampled)
    first = sampled.index(True)
    assert 1 <= sum(sampled) <= 8 and all(sampled[first:]) and not any(sampled[:first])

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(shared_inference_process.model, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    recomputed = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    served = torch.tensor(logprobs[1:])
    mask = torch.tensor(sampled[1:])
    assert torch.allclose(served[mask], recomputed[mask], atol=1e-4), (served[mask], recomputed[mask])


class ScriptedEngine:
    """Plays the engine behind `/inference/v1/generate`: each request gets the next scripted reply as token ids
    (the tiny byte tokenizer's) with a logprob per token; records the prompt ids it was sent."""

    def __init__(self, tokenizer, replies: list[str]):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.replies, self.prompts = [tokenizer.encode(r, add_special_tokens=False) for r in replies], []
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):  # /v1/models: no max_model_len, so the client skips its length pre-check
                self._send({"object": "list", "data": []})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                engine.prompts.append(body["token_ids"])
                ids = engine.replies.pop(0)
                lps = [{"token": f"token_id:{t}", "logprob": -0.5} for t in ids]
                self._send({"choices": [{"index": 0, "token_ids": ids, "logprobs": {"content": lps},
                                         "finish_reason": "stop"}]})  # fmt: skip

            def _send(self, payload):
                data = json.dumps(payload).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_port}/v1"


def test_a_tool_episode_through_the_training_client_trains_on_the_model_turns_only(tiny_model_dir, monkeypatch):
    """tool-calc through verifiers' training client: the renderer (model's own template + qwen3 tool parser)
    turns the engine's `<tool_call>` tokens into a call, the calculator's MCP server answers, the second turn
    answers; the trace's tokens are the engine's, its tool reply masked out of the loss."""
    from transformers import AutoTokenizer

    from asyncrl.config.orchestrator import ClientConfig, EnvConfig
    from asyncrl.orchestrator.envs.mixture import EnvMixture, group_inputs
    from asyncrl.orchestrator.envs.runners import runners_for
    from asyncrl.orchestrator.samples import TrajectoryConverter

    monkeypatch.setenv("ASYNCRL_TEST_V1_KEY", "unused")
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    mixture = EnvMixture.load([EnvConfig(id="tool-calc", args={"num_train_examples": 2})], seq_len=None)
    slot = mixture.slots[0]
    task = slot.rows[0]
    call = json.dumps({"name": "calculate", "arguments": {"expression": task.data.expression}})
    engine = ScriptedEngine(tok, [f"<tool_call>\n{call}\n</tool_call><|im_end|>", f"{task.data.answer}<|im_end|>"])
    renderer = {"name": "default", "tool_parser": "qwen3"}
    client = ClientConfig(base_url=engine.url, api_key_var="ASYNCRL_TEST_V1_KEY")
    runners = runners_for(mixture.slots, client, str(tiny_model_dir), str(tiny_model_dir), renderer=renderer)

    async def go():
        try:
            return await runners.run_group(slot, group_inputs(task, 1), {"n": 1, "temperature": 1.0})
        finally:
            await runners.close()

    (out,) = asyncio.run(go())
    engine.httpd.shutdown()
    assert "error" not in out, out.get("error")
    assert out["reward"] == 1.0 and out["metrics"]["calculate_calls"] == 1.0, out["metrics"]
    assert out["tool_defs"] and out["tool_defs"][0]["function"]["name"] == "calculate"
    assert [m.role for m in out["completion"]] == ["assistant", "tool", "assistant"]
    assert out["completion"][1].content == task.data.answer  # the calculator's reply
    # the second request's prompt is the first's, then the sampled call, then the tool reply (rendered)
    first, second = engine.prompts
    assert second[: len(first)] == first and tok.decode(second).count("<tool_response>") == 1
    (rollout,) = [TrajectoryConverter().convert(out, slot.name)]
    assert rollout.ok
    trained = [t for s in rollout.samples for t, m in zip(s.input_ids, s.loss_mask) if m]
    assert tok.decode(trained) == f"<tool_call>\n{call}\n</tool_call><|im_end|>{task.data.answer}<|im_end|>"
