"""An episode whose turns span two policy versions is recorded for training as each turn was sampled.

With `max_async_level` > 0 the trainer publishes new weights while episodes are in flight, so a multi-turn
episode's later turns can come from a newer policy than its first. The importance ratios of the loss are only
right if every token's sampler logprob is that of the policy that sampled it. Here a real embedded engine
serves echo-twice (two model turns) through the orchestrator's v1 runner; a proxy in front of the engine loads
other weights (`/update_weights`) between the episode's two model calls. The training row's logprobs must
equal, token by token, a plain HF forward of the first weights on turn 1's tokens and of the second weights on
turn 2's (and not the first weights' there: the update happened between the turns), in whichever rows the
turns are trained.
"""

from __future__ import annotations

import asyncio
import sys
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import httpx
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # server_proc
from server_proc import API_KEY, AUTH, start_server  # noqa: E402

from asyncrl.config.orchestrator import ClientConfig, EnvConfig, SamplingConfig  # noqa: E402
from asyncrl.orchestrator.envs.mixture import EnvMixture, group_inputs  # noqa: E402
from asyncrl.orchestrator.envs.runners import runners_for, sampling_args  # noqa: E402
from asyncrl.orchestrator.samples import TrajectoryConverter  # noqa: E402
from tests.local_http import LocalHTTP  # noqa: E402

pytestmark = pytest.mark.slow
KEY_VAR = "ASYNCRL_TEST_TURNS_KEY"
GENERATE = "/inference/v1/generate"


class SwapBeforeSecondCall(LocalHTTP):
    """A proxy in front of the engine: before it forwards the second generate request, the engine loads
    `weight_dir` (and answers); every request is forwarded as it came, its answer returned as it came."""

    def __init__(self, engine_url: str, weight_dir: Path) -> None:
        self.engine_url, self.weight_dir = engine_url, weight_dir
        self.calls: list[str] = []  # "generate" / "update_weights", in the order the engine got them
        super().__init__(self._handler())

    def forward(self, method: str, path: str, body: bytes, headers: dict) -> httpx.Response:
        if path == GENERATE:
            if self.calls.count("generate") == 1:
                swap = httpx.post(f"{self.engine_url}/update_weights", json={"weight_dir": str(self.weight_dir)},
                                  headers=AUTH, timeout=120)  # fmt: skip
                assert swap.status_code == 200, swap.text
                self.calls.append("update_weights")
            self.calls.append("generate")
        return httpx.request(method, self.engine_url + path, content=body, headers=headers, timeout=120)

    def _handler(self):
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                self.relay(b"")

            def do_POST(self):
                self.relay(self.rfile.read(int(self.headers.get("Content-Length", 0))))

            def relay(self, body: bytes) -> None:
                keep = {k: v for k, v in self.headers.items() if k.lower() in ("authorization", "content-type")}
                answer = proxy.forward(self.command, self.path, body, keep)
                self.send_response(answer.status_code)
                self.send_header("Content-Type", answer.headers.get("content-type", "application/json"))
                self.send_header("Content-Length", str(len(answer.content)))
                self.end_headers()
                self.wfile.write(answer.content)

        return Handler


def one_episode(proxy_url: str, model: Path):
    """One echo-twice episode (a group of one) through the orchestrator's v1 runner, as its training rollout."""
    mixture = EnvMixture.load([EnvConfig(id="echo-twice")], seq_len=None)
    slot = mixture.slots[0]
    runners = runners_for(mixture.slots, ClientConfig(base_url=proxy_url, api_key_var=KEY_VAR), str(model), str(model))
    sampling = sampling_args(SamplingConfig(max_tokens=8, temperature=1.0))

    async def main():
        try:
            return await runners.run_group(slot, group_inputs(slot.rows[0], 1), sampling)
        finally:
            await runners.close()

    (output,) = asyncio.run(main())
    return TrajectoryConverter().convert(output, slot.name)


def runs(mask: list[bool]) -> list[list[int]]:
    """The positions of each contiguous run of trained tokens (one per model turn)."""
    out: list[list[int]] = []
    for i, on in enumerate(mask):
        if on and (not out or out[-1][-1] != i - 1):
            out.append([])
        if on:
            out[-1].append(i)
    return out


def hf_logprobs(model_dir: Path, ids: list[int]) -> torch.Tensor:
    """logprob of each token given those before it (position 0: 0), from a plain HF forward."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    chosen = logits.log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    return torch.cat([torch.zeros(1), chosen])


def test_each_turn_keeps_the_logprobs_of_the_policy_that_sampled_it(tiny_model_dir, tmp_path, monkeypatch):
    from asyncrl.utils.tiny_model import build_tiny_model

    monkeypatch.setenv(KEY_VAR, API_KEY)
    newer = build_tiny_model(tmp_path / "newer", hidden_size=64, num_layers=2, seed=1)
    server = start_server("embedded", tiny_model_dir, allowed_weights_root=tmp_path.resolve())
    proxy = SwapBeforeSecondCall(server.base_url, newer)
    try:
        rollout = one_episode(proxy.url, tiny_model_dir)
    finally:
        proxy.close()
        server.stop()
    assert rollout.error is None and rollout.num_turns == 2, rollout.error
    assert proxy.calls == ["generate", "update_weights", "generate"]
    # one row with both turns (interleaved), or a row per turn where the chat template rewrites history (Qwen3's
    # drops the earlier turn's thinking): either way, the turns in order with the row each is trained in
    turns = [(s, run) for s in rollout.samples for run in runs(s.loss_mask)]
    assert len(turns) == 2, [s.loss_mask for s in rollout.samples]
    for (sample, run), weights in zip(turns, (tiny_model_dir, newer)):
        recorded = torch.tensor(sample.logprobs)[run]
        expected = hf_logprobs(weights, sample.input_ids)[run]
        assert torch.allclose(recorded, expected, atol=1e-4), (weights.name, recorded, expected)
    (sample, run) = turns[1]
    first_weights = hf_logprobs(tiny_model_dir, sample.input_ids)[run]
    assert (torch.tensor(sample.logprobs)[run] - first_weights).abs().max() > 0.05  # turn 2: not the first policy
