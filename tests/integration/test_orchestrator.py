"""Orchestrator + embedded inference server + a fake trainer, on a tiny model, for each shipped environment.

The model is the tiny random model after a few seconds of SFT on short chat replies, so that turns end
with <|im_end|> (a random model runs every turn into max_tokens, and verifiers then re-renders the next
prompt from text, so multi-turn rollouts could not be interleaved). The fake trainer reads each batch,
perturbs the weights and publishes them as `broadcast/step_{n+1}`,
so the orchestrator really tells the server to load new weights. Afterwards every batch is checked:
ids/positions/masks line up, advantages are per-sample constants summing to zero per step, and the
inference logprobs on loss tokens equal a fresh forward pass of the policy the batch says it used.
"""

from __future__ import annotations

import asyncio
import copy
import json
import random
import sys
import threading
from pathlib import Path

import pytest
import torch
from server_proc import serve_in_thread

from asyncrl.config.orchestrator import OrchestratorConfig
from asyncrl.transport.batch import read_batch, read_meta, wait_for_batch
from asyncrl.transport.files import publish_dir
from asyncrl.transport.layout import RunLayout
from asyncrl.transport.prefix import segments

pytestmark = pytest.mark.slow
sys.path.insert(0, str(Path(__file__).resolve().parent / "v1_envs"))  # reverse_v1, not installed

STEPS = 3
# env id -> (load_environment args, seq_len); tool-calc's prompt carries the tool schema (~650 tokens).
TOOL_RENDERER = {"name": "default", "tool_parser": "qwen3"}
ENVS = {  # env id: (args, seq_len, more orchestrator config); all verifiers v1 tasksets
    "reverse-text": ({"num_train_examples": 50, "num_eval_examples": 4}, 256, {}),
    "echo-twice": ({"num_train_examples": 50, "num_eval_examples": 4}, 256, {}),
    # tools: the renderer parses the model's <tool_call> blocks (a random model rarely writes one)
    "tool-calc": ({"num_train_examples": 50, "num_eval_examples": 4}, 1024, {"renderer": TOOL_RENDERER}),
    "reverse-v1": ({}, 256, {}),  # a taskset that is not installed (v1_envs/reverse_v1, on sys.path)
}


@pytest.fixture(scope="module")
def chat_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model trained briefly to answer short lowercase words followed by <|im_end|>."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    rng = random.Random(0)

    def example() -> tuple[list[int], list[int]]:
        w = "".join(rng.choice("abcdefghij") for _ in range(rng.randint(3, 6)))
        msgs = [{"role": "user", "content": rng.choice(["Say exactly: ", "Reverse the text: "]) + w}]
        if rng.random() < 0.5:
            msgs += [{"role": "assistant", "content": w}, {"role": "user", "content": "Say it again."}]
        prompt = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        return tok.encode(prompt, add_special_tokens=False), tok.encode(w + "<|im_end|>", add_special_tokens=False)

    for _ in range(60):
        rows = [example() for _ in range(12)]
        width = max(len(p) + len(c) for p, c in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        labels = torch.full((len(rows), width), -100)
        mask = torch.zeros_like(ids)
        for i, (p, c) in enumerate(rows):
            ids[i, : len(p) + len(c)] = torch.tensor(p + c)
            labels[i, len(p) : len(p) + len(c)] = torch.tensor(c)
            mask[i, : len(p) + len(c)] = 1
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    out = tmp_path_factory.mktemp("chat_model")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def server(chat_model_dir):
    from asyncrl.config.inference import InferenceConfig
    from asyncrl.inference.api.app import create_app
    from asyncrl.inference.engine import EmbeddedEngine

    torch.set_num_threads(1)
    config = InferenceConfig(
        model={
            "name": str(chat_model_dir),
            "max_model_len": 2048,
            "enable_auto_tool_choice": True,
            "tool_call_parser": "hermes",
        },
        max_batch_size=16,
        seed=0,
    )
    url, stop = serve_in_thread(create_app(EmbeddedEngine(config), config), 120)
    yield url + "/v1", chat_model_dir
    stop()


class WeightTrainer(threading.Thread):
    """Consumes rollouts/step_n and publishes perturbed real weights as broadcast/step_{n+1}."""

    def __init__(self, out: Path, model_dir: Path, steps: int):
        super().__init__(daemon=True)
        self.out, self.model_dir, self.steps = out, model_dir, steps
        self.policies: dict[int, dict] = {}
        self.batches: dict[int, tuple[list, dict]] = {}  # the orchestrator prunes consumed batches
        self.error: BaseException | None = None
        self.stop = False

    def run(self):
        try:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
            self.policies[0] = copy.deepcopy(model.state_dict())
            layout = RunLayout(self.out)
            for n in range(self.steps):
                wait_for_batch(layout, n, timeout=600, poll=0.02, should_stop=lambda: self.stop)
                self.batches[n] = (read_batch(layout, n, 0), read_meta(layout, n))  # checked later
                gen = torch.Generator().manual_seed(n)
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(torch.randn(p.shape, generator=gen) * 0.05)
                self.policies[n + 1] = copy.deepcopy(model.state_dict())
                publish_dir(RunLayout(self.out).broadcast_dir(n + 1), model.save_pretrained)
        except BaseException as e:  # surfaced by the test
            self.error = e


def _segments(mb):
    starts = (mb.position_ids == 0).nonzero().flatten().tolist() + [len(mb.position_ids)]
    return [slice(a, b) for a, b in zip(starts, starts[1:])]


def check_batches(trainer: WeightTrainer, model_dir: Path, steps: int, k: int, seq_len: int) -> list[int]:
    """Check every sample of every batch; returns the number of model turns in each sample."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    turns_per_sample, shared_rows = [], 0
    for n in range(steps):
        mbs, meta = trainer.batches[n]
        assert n - meta["min_policy_step"] <= k
        assert meta["min_policy_step"] == meta["policy_step"]  # no oversampling: one policy per batch
        model.load_state_dict(trainer.policies[meta["policy_step"]])
        adv_sum, samples, max_err = 0.0, 0, 0.0
        for packed in mbs:
            assert len(packed.input_ids) <= seq_len
            mb = packed.expanded()  # shared prompts copied back: one plain sample per segment
            shared_rows += segments(packed.position_ids).shared
            for sl in _segments(mb):
                ids, mask, adv = mb.input_ids[sl], mb.loss_mask[sl], mb.advantages[sl]
                if not mask.any():
                    continue  # a dummy row
                samples += 1
                assert ids[0] == im_start and not mask[0]  # starts with the (unmasked) chat prompt
                assert torch.all(adv[mask] == adv[mask][0])  # a shared prompt carries its first sample's
                adv_sum += adv[mask][0].item()
                assert (mb.inference_logprobs[sl][~mask] == 0).all()
                assert torch.all(mb.temperatures[sl] == 1.0)
                turns = int(((mask[1:].int() - mask[:-1].int()) == 1).sum())  # masked runs = model turns
                turns_per_sample.append(turns)
                if turns == 2:  # an interleaved sample: the env's message sits unmasked between the turns
                    assert "Say it again." in tok.decode(ids[~mask])
                with torch.no_grad():
                    logits = model(input_ids=ids[None]).logits[0].float()
                lp = torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None])[:, 0]
                got = mb.inference_logprobs[sl][1:][mask[1:]]
                max_err = max(max_err, (lp[mask[1:]] - got).abs().max().item())
        assert samples == meta["num_samples"] > 0
        assert abs(adv_sum) < 1e-4  # reward - group mean sums to zero within each group
        assert max_err < 1e-3, f"step {n}: inference logprobs differ from policy {meta['policy_step']} by {max_err}"
    assert shared_rows > 0  # share_prefix is on by default: each group's prompt is packed once
    return turns_per_sample


@pytest.mark.parametrize("env_id", list(ENVS))
def test_three_steps_per_environment(env_id, server, tmp_path):
    from asyncrl.orchestrator.process import orchestrate

    url, model_dir = server
    args, seq_len, more = ENVS[env_id]
    k = 1
    config = OrchestratorConfig(
        model={"name": str(model_dir)},
        client={"base_url": url},
        env=[{"id": env_id, "args": args}],
        batch_size=8,
        rollouts_per_example=4,
        seq_len=seq_len,
        max_steps=STEPS,
        max_async_level=k,
        sampling={"max_tokens": 16},
        output_dir=tmp_path,
        eval={"interval": 2, "num_examples": 2},
        num_train_workers=1,
        **more,
    )
    trainer = WeightTrainer(tmp_path, model_dir, STEPS)
    trainer.start()
    try:
        asyncio.run(orchestrate(config, RunLayout.for_config(config)))
    finally:
        trainer.stop = True
        trainer.join(60)
    assert trainer.error is None, trainer.error
    rows = [json.loads(line) for line in (tmp_path / "metrics" / "orchestrator.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    assert [r["step"] for r in train] == list(range(STEPS))
    # every `interval` steps, and the final policy (broadcast/step_STEPS) once the trainer published it
    assert [r["step"] for r in evals] == [0, 2, STEPS] and all(r["eval/rollouts"] == 2 for r in evals)
    assert evals[-1]["policy/step"] == STEPS
    errors = sum(r["rollouts/errors"] for r in train)
    # An empty reply is an error to verifiers (EmptyModelResponseError): masked out, counted, not fatal.
    assert errors <= STEPS * 8 // 2, f"{errors} errored rollouts"
    assert all(r["off_policy/level"] <= k for r in train)
    assert max(r["policy/step"] for r in train) >= 1  # the server really got new weights
    assert all(r["perf/gen_tokens_per_s"] > 0 and f"reward/{env_id}/mean" in r for r in train)
    turns = check_batches(trainer, model_dir, STEPS, k, seq_len)
    if env_id == "echo-twice":  # multi-turn rollouts became single interleaved samples
        assert turns.count(2) >= 0.75 * len(turns), turns
        assert all(r["num_turns/mean"] > 1.5 for r in train)
    else:
        assert set(turns) == {1}


def test_bench_reports_throughput(server, tmp_path, capsys):
    from asyncrl.orchestrator.process import orchestrate

    url, model_dir = server
    config = OrchestratorConfig(
        model={"name": str(model_dir)},
        client={"base_url": url},
        env=[{"id": "reverse-text"}],
        batch_size=8,
        rollouts_per_example=4,
        seq_len=256,
        max_steps=2,
        sampling={"max_tokens": 16},
        output_dir=tmp_path,
        bench=True,
    )
    asyncio.run(orchestrate(config, RunLayout.for_config(config)))
    out = capsys.readouterr().out
    assert "rollouts/s" in out and "gen tok/s" in out
    total = [line for line in out.splitlines() if line.strip().startswith("total ")]
    assert total and float(total[0].split()[3]) > 0 and float(total[0].split()[4]) > 0
    assert not (tmp_path / "rollouts").exists()  # bench writes no batches
