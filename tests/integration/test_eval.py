"""`eval` against our server: a weights dir of two SFT steps gives a table and per-rollout results."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from server_proc import ServerProcess

from tests import warm

pytestmark = pytest.mark.slow

EVAL = [sys.executable, "-m", "asyncrl.entrypoints.eval"]


@pytest.fixture(scope="module")
def weights(tiny_model_dir, tmp_path_factory) -> Path:
    """weights/step_1 and step_2 of a short SFT run from the tiny model (so the server can load them)."""
    from reverse_text import sft_examples, write_jsonl

    from asyncrl.config.sft import SFTConfig
    from asyncrl.trainer.sft import train_sft as train_sft_in
    from asyncrl.transport.layout import RunLayout

    train_sft = lambda cfg: train_sft_in(cfg, RunLayout.for_config(cfg))  # noqa: E731  (as its entrypoint runs it)

    root = tmp_path_factory.mktemp("eval_sft")
    data = write_jsonl(root / "data.jsonl", sft_examples(200))
    train_sft(
        SFTConfig(
            model={"name": str(tiny_model_dir)},
            data={"name": str(data), "seq_len": 256, "batch_size": 4, "micro_batch_size": 2},
            optim={"lr": 1e-2},
            max_steps=2,
            ckpt={"interval": 1},
            output_dir=root / "run",
            device="cpu",
        )
    )
    return root / "run" / "weights"


@pytest.fixture(scope="module")
def server(shared_inference_process):
    return shared_inference_process  # tests/conftest.py: the session's one, shared with the synthesize suite


def run_eval(server: ServerProcess, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return server.run_client(EVAL, out, "--sampling.max-tokens", "10", "--sampling.seed", "7", *extra)


def test_eval_over_two_steps_prints_table_and_writes_results(server, weights, tmp_path):
    done = run_eval(
        server,
        tmp_path,
        "--environment-ids",
        "reverse-text,echo-twice",
        "--num-examples",
        "3",
        "--rollouts-per-example",
        "2",
        "--weights-dir",
        str(weights),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    table = done.stdout.splitlines()
    assert table[0].split(" | ")[0].strip() == "step" and "reverse-text" in table[0] and "echo-twice" in table[0]
    assert [line.split(" | ")[0].strip() for line in table[2:5]] == ["base", "step_1", "step_2"]
    assert all("±" in line for line in table[2:5])
    rows = [json.loads(line) for line in (tmp_path / "eval" / "rollouts.jsonl").read_text().splitlines()]
    assert len(rows) == 3 * 2 * 3 * 2  # targets x envs x examples x rollouts
    assert {r["label"] for r in rows} == {"base", "step_1", "step_2"}
    assert {"reward", "metrics", "completion_text", "example_id", "env", "step"} <= set(rows[0])
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert list(summary["results"]) == ["base", "step_1", "step_2"]
    assert "exact_match" in summary["results"]["base"]["reverse-text"]["metrics"]
    page = (tmp_path / "report.html").read_text()  # eval writes the report at the end
    assert "eval reward by weights step (eval)" in page and "eval step_2, best: reward" in page

    # seeded sampling: the answers change only if the server really switched weights
    def answers(label: str) -> list[str]:
        return [r["completion_text"] for r in rows if r["label"] == label and r["env"] == "reverse-text"]

    assert answers("base") != answers("step_2")
    # and the server is back on the base model afterwards
    prompt = next(r["prompt"] for r in rows if r["label"] == "base" and r["env"] == "reverse-text")
    import httpx

    reply = httpx.post(
        f"{server.url}/chat/completions",
        timeout=60,
        json={"model": server.model, "messages": prompt, "max_tokens": 10, "seed": 7},
    ).json()
    assert reply["choices"][0]["message"]["content"] == answers("base")[0]


def test_eval_chosen_steps_without_base(server, weights, tmp_path):
    done = run_eval(
        server,
        tmp_path,
        "--environment-ids",
        "reverse-text",
        "--num-examples",
        "2",
        "--weights-dir",
        str(weights),
        "--steps",
        "2",
        "--no-eval-base",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert list(summary["results"]) == ["step_2"]


def test_eval_plain_server_model(server, tmp_path):
    done = run_eval(server, tmp_path, "--environment-ids", "tool-calc", "--num-examples", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[2].startswith("model")


def test_eval_resolves_an_endpoint_name(server, tmp_path):
    """`--model.name NAME` through an endpoints registry reaches the server named there (no --client.base-url)."""
    registry = tmp_path / "endpoints.py"
    entry = {"model": server.model, "url": server.url, "key": "ASYNCRL_TEST_NO_KEY"}
    registry.write_text(f"ENDPOINTS = {{'tiny-local': {entry!r}}}\n")
    cmd = [*EVAL, "--model.name", "tiny-local", "--endpoints-path", str(registry), "--output-dir", str(tmp_path)]
    args = ["--environment-ids", "reverse-text", "--num-examples", "2", "--sampling.max-tokens", "10"]
    done = warm.run([*cmd, *args], capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert (summary["model"], summary["base_url"]) == (server.model, server.url)
    assert summary["results"]["model"]["reverse-text"]["errors"] == 0

    wrong = warm.run([*cmd[:4], "nope", *cmd[5:], *args], capture_output=True, text=True, timeout=120)
    assert wrong.returncode == 2
    line = f"error: --model.name 'nope' is not an endpoint in {registry} (known: tiny-local)"
    assert line in wrong.stderr.splitlines() and "Traceback" not in wrong.stderr
