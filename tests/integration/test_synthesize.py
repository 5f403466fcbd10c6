"""`synthesize` against our server: single-turn, multi-turn and tool environments -> an SFT dataset -> `sft`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from server_proc import ServerProcess

pytestmark = pytest.mark.slow

SYNTH = [sys.executable, "-m", "asyncrl.entrypoints.synthesize"]


@pytest.fixture(scope="module")
def server(shared_inference_process):
    return shared_inference_process  # tests/conftest.py: the session's one, shared with the eval suite


def synthesize(
    server: ServerProcess,
    out: Path,
    examples: int,
    rollouts: int,
    *extra: str,
    envs: str = "reverse-text,echo-twice,tool-calc",
):
    counts = ["--num-examples", str(examples), "--rollouts-per-example", str(rollouts)]
    return server.run_client(SYNTH, out, "--environment-ids", envs, *counts, "--sampling.max-tokens", "12", *extra)


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_synthesize_resumes_and_feeds_sft(server, tiny_model_dir, tmp_path):
    data = tmp_path / "synthetic" / "data.jsonl"
    first = synthesize(server, tmp_path, 3, 2)
    assert first.returncode == 0, first.stderr[-3000:]
    progress = lines(data.with_name("data.jsonl.progress"))
    assert {(p["env"], p["example_id"]) for p in progress} <= {
        (e, i) for e in ("reverse-text", "echo-twice", "tool-calc") for i in range(3)
    }
    rows = lines(data)
    assert rows, first.stderr[-2000:]
    for row in rows:
        assert row["prompt"] and row["completion"][0]["role"] == "assistant"
        assert ("tools" in row) == (row["env"] == "tool-calc")
    echo = [r for r in rows if r["env"] == "echo-twice"]
    assert not echo or [m["role"] for m in echo[0]["completion"]] == ["assistant", "user", "assistant"]
    keys = [(r["env"], r["example_id"], r["rollout"]) for r in rows]
    assert len(keys) == len(set(keys))

    again = synthesize(server, tmp_path, 3, 2)  # nothing missing: nothing appended
    assert again.returncode == 0 and lines(data) == rows
    more = synthesize(server, tmp_path, 4, 3)  # one more example per env, one more rollout per example
    assert more.returncode == 0, more.stderr[-3000:]
    grown = lines(data)
    assert grown[: len(rows)] == rows
    keys = [(r["env"], r["example_id"], r["rollout"]) for r in grown]
    assert len(keys) == len(set(keys)) and max(r["rollout"] for r in grown) <= 2
    done = {(p["env"], p["example_id"]): p["rollouts"] for p in lines(data.with_name("data.jsonl.progress"))}
    assert set(done.values()) <= {2, 3}

    # sft trains on the file directly (tool rows render their tool definitions)
    from asyncrl.config.sft import SFTConfig
    from asyncrl.trainer.sft import train_sft as train_sft_in
    from asyncrl.transport.layout import RunLayout

    train_sft = lambda cfg: train_sft_in(cfg, RunLayout.for_config(cfg))  # noqa: E731  (as its entrypoint runs it)

    history = train_sft(
        SFTConfig(
            model={"name": str(tiny_model_dir)},
            data={"name": str(data), "seq_len": 1024, "batch_size": 2, "micro_batch_size": 1},
            max_steps=2,
            output_dir=tmp_path / "sft",
            device="cpu",
        )
    )
    assert len(history) == 2 and all(m["loss_tokens"] > 0 for m in history)
    assert (tmp_path / "sft" / "weights" / "step_2" / "STABLE").exists()


def test_min_reward_filters_rows(server, tmp_path):
    done = synthesize(server, tmp_path, 4, 2, "--min-reward", "0.2", envs="reverse-text")
    assert done.returncode == 0, done.stderr[-3000:]
    data = tmp_path / "synthetic" / "data.jsonl"
    rows = lines(data) if data.exists() else []
    assert all(r["reward"] >= 0.2 for r in rows)
    assert sum(p["rollouts"] for p in lines(data.with_name("data.jsonl.progress"))) == 8  # all run, some kept
