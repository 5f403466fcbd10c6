"""`rl --bench` end to end on CPU (with a cached warm model), and the SFT warm-up with a tiny budget."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from asyncrl.config import bench as job
from asyncrl.utils.process import free_port
from tests import warm

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TIMES = ("step_s", "generation_s", "training_s", "weight_update_s", "publish_s", "load_s")


def _fake_warm_model(out: Path) -> Path:
    """A random tiny model where `rl --bench` caches its warmed one, so the minutes-long warm-up is skipped."""
    from asyncrl.utils.tiny_model import build_tiny_model

    root = job.warm_dir(out)
    build_tiny_model(root / "model", hidden_size=64, num_layers=2)
    (root / "warmup.json").write_text(json.dumps({"key": job.warm_key(), "sft_step": 0, "seconds": 0.0}))
    return root


def _check_accuracy(result: dict) -> None:
    assert result["words"] == job.HELDOUT_WORDS and result["samples_per_word"] == job.SAMPLES_PER_WORD
    assert 0.0 <= result["greedy"] <= 1.0 and 0.0 <= result["sampled"] <= 1.0


def test_rl_bench_writes_every_number(tmp_path):
    out = tmp_path / "bench"
    root = _fake_warm_model(out)
    cmd = [sys.executable, "-m", "asyncrl.entrypoints.rl", "--bench", "--max-steps", "4", "--output-dir", str(out)]
    cmd += ["--inference.server.port", str(free_port())]
    proc = warm.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "bench.json").read_text())
    assert result["steps"] == 4 and result["measured_steps"] == [2, 3] and result["warmup_steps"] == 2
    for key in TIMES:
        assert result[key]["median"] > 0 and result[key]["mean"] > 0, key
    assert result["step_s"]["median"] < 60 and result["generation_s"]["median"] < result["step_s"]["median"] * 3
    assert 0.3 < result["overlap"] < 5
    for when in ("before", "after"):
        _check_accuracy(result["heldout"][when])
    assert result["warm_model"]["cached"] and result["warm_model"]["path"] == str(root / "model")
    assert result["job"]["batch_size"] == 128 and result["job"]["max_async_level"] == 1
    assert result["job"]["env"][0]["args"]["reward"] == "exact"
    assert json.loads((root / "warmup.json").read_text())["heldout"] == result["heldout"]["before"]  # cached too
    assert "warm-up skipped" in proc.stdout and f"numbers in {out / 'bench.json'}" in proc.stdout
    assert "s/step" in proc.stdout and "held-out exact match (128 words)" in proc.stdout


def test_warmup_builds_trains_chooses_and_is_reused(tmp_path):
    from asyncrl.bench.warmup import ensure_warm_model

    spec = {"max_steps": 4, "interval": 2, "target_accuracy": 0.0, "sft_examples": 200}
    warm = ensure_warm_model(tmp_path / "w", spec)
    assert not warm.cached and warm.info["sft_step"] == 2  # the first checkpoint reaches 0.0
    assert (warm.path / "config.json").exists() and (warm.path / "STABLE").exists()
    assert not (tmp_path / "w" / "sft" / "checkpoints").exists() and not (tmp_path / "w" / "sft" / "weights").exists()
    assert [s["step"] for s in warm.info["validation"]] == [2]
    again = ensure_warm_model(tmp_path / "w", spec)
    assert again.cached and again.info == json.loads((tmp_path / "w" / "warmup.json").read_text())
