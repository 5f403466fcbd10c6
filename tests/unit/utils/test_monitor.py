"""Metrics sink: JSON lines always, W&B only when configured (and installed)."""

import importlib.util
import json

import pytest

from asyncrl.config.base import WandbConfig
from asyncrl.core.errors import UserError
from asyncrl.transport.layout import RunLayout
from asyncrl.utils.monitor import MetricsSink


def test_jsonl_lines_per_step(tmp_path):
    sink = MetricsSink(RunLayout(tmp_path), "trainer", None, {}, enabled=True)
    sink.log(0, {"loss": 1.5, "mfu": None})
    sink.log(1, {"loss": 0.5, "mfu": None})
    sink.close()
    rows = [json.loads(x) for x in (tmp_path / "metrics" / "trainer.jsonl").read_text().splitlines()]
    times = [r.pop("time") for r in rows]
    assert times == sorted(times)
    assert rows == [{"step": 0, "loss": 1.5, "mfu": None}, {"step": 1, "loss": 0.5, "mfu": None}]


def test_disabled_on_other_ranks(tmp_path):
    MetricsSink(RunLayout(tmp_path), "trainer", WandbConfig(), {}, enabled=False).log(0, {"loss": 1.0})
    assert not (tmp_path / "metrics").exists()


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed")
def test_wandb_missing_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="wandb is not installed"):
        MetricsSink(RunLayout(tmp_path), "trainer", WandbConfig(), {}, enabled=True)


def test_wandb_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    sink = MetricsSink(RunLayout(tmp_path), "trainer", WandbConfig(name="t", offline=True), {"a": 1}, enabled=True)
    sink.log(0, {"loss": 1.0})
    sink.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert runs and sink.run is None


def test_extras_are_due_on_their_interval_with_wandb_on_only(tmp_path):
    cfg = WandbConfig(log_extras={"distributions": False, "interval": 5})
    sink = MetricsSink(RunLayout(tmp_path), "trainer", cfg, {}, enabled=False)
    assert not sink.extras_due(0, "samples")  # W&B is not running (other rank / off)
    sink.run = object()
    assert [s for s in range(12) if sink.extras_due(s, "samples")] == [0, 5, 10]
    assert not any(sink.extras_due(s, "distributions") for s in range(12))
