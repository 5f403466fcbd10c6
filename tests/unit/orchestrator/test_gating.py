"""Async gating: a fake trainer publishes weight dirs on a schedule; the orchestrator never runs more than
k steps ahead of it, and never waits when it is within the bound."""

import asyncio
import json
import threading
import time

import pytest
from orch_fakes import FakeRunner, FakeServer, fake_mixture

from asyncrl.config.orchestrator import OrchestratorConfig
from asyncrl.orchestrator.gating import Policy, PolicyGate
from asyncrl.orchestrator.loop import Orchestrator
from asyncrl.transport.batch import read_meta, wait_for_batch
from asyncrl.transport.files import publish_dir
from asyncrl.transport.layout import RunLayout


def publish(out, step):
    publish_dir(RunLayout(out).broadcast_dir(step), lambda d: (d / "config.json").write_text("{}"))


class FakeTrainer(threading.Thread):
    """Consumes rollouts/step_n, 'trains' for train_s, publishes broadcast/step_{n+1}; logs event times."""

    def __init__(self, out, steps, train_s):
        super().__init__(daemon=True)
        self.out, self.steps, self.train_s = out, steps, train_s
        self.published: dict[int, float] = {}
        self.stop = False

    def run(self):
        for n in range(self.steps):
            wait_for_batch(RunLayout(self.out), n, timeout=60, poll=0.005, should_stop=lambda: self.stop)
            time.sleep(self.train_s)
            publish(self.out, n + 1)
            self.published[n + 1] = time.monotonic()


def run_orchestrator_with_trainer(tmp_path, k, steps, train_s, gen_delay, async_lag="at_most"):
    config = OrchestratorConfig(
        async_lag=async_lag,
        batch_size=8,
        rollouts_per_example=4,
        seq_len=64,
        max_steps=steps,
        max_async_level=k,
        output_dir=tmp_path,
        num_train_workers=1,
    )
    runner = FakeRunner(delay=gen_delay)
    server = FakeServer(runner)
    orch = Orchestrator(config, fake_mixture(), runner, server, layout=RunLayout.for_config(config))
    trainer = FakeTrainer(tmp_path, steps, train_s)
    trainer.start()
    written: dict[int, float] = {}
    metas: dict[int, dict] = {}
    original = orch._finish  # a step's batch is written when its finishing returns

    async def timed_finish(gen):
        record = await original(gen)
        written[gen.step] = time.monotonic()
        metas[gen.step] = read_meta(RunLayout(tmp_path), gen.step)  # before a later step prunes consumed batches
        return record

    orch._finish = timed_finish
    try:
        asyncio.run(orch.run())
    finally:
        trainer.stop = True
        trainer.join(timeout=30)
    records = [json.loads(line) for line in (tmp_path / "metrics" / "orchestrator.jsonl").read_text().splitlines()]
    return orch, server, trainer, written, records, metas


@pytest.mark.parametrize("k", [0, 1, 2])
def test_never_more_than_k_ahead_of_a_slow_trainer(tmp_path, k):
    steps = 6
    orch, server, trainer, written, records, metas = run_orchestrator_with_trainer(
        tmp_path, k, steps, train_s=0.25, gen_delay=0.005
    )
    assert [r["step"] for r in records] == list(range(steps))
    for r in records:
        n = r["step"]
        assert n - r["policy/step"] <= k and r["off_policy/level"] <= k
        assert metas[n]["policy_step"] == r["policy/step"] and metas[n]["num_samples"] == 8
        lags = {int(lag): count for lag, count in metas[n]["staleness"].items()}  # each sample's policy stamp
        assert sum(lags.values()) == 8 and max(lags) == r["off_policy/level"] == n - metas[n]["min_policy_step"]
        if n - k >= 1:  # the batch of step n exists only after the trainer published weights n-k
            assert trainer.published[n - k] <= written[n]
    # Slow trainer: the first k+1 steps go without waiting, later ones wait and run exactly k behind.
    for r in records[: k + 1]:
        assert r["time/wait_weights"] < 0.1
    for r in records[k + 1 :]:
        assert r["off_policy/level"] == k
    assert sum(r["time/wait_weights"] for r in records[k + 1 :]) > 0.1 * (steps - k - 1)
    # Weights change only between steps: nothing was in flight at any update.
    assert server.calls and all(in_flight == 0 for _, _, in_flight in server.calls)
    assert server.calls[0][0] == "reload"  # step 0 starts from the base model explicitly
    updated = [int(path.rsplit("_", 1)[1]) for kind, path, _ in server.calls if kind == "update"]
    assert updated == sorted(updated) and len(set(updated)) == len(updated)
    # Consumed batches are pruned, the ones the trainer may still need are kept.
    kept = sorted(int(p.name.split("_")[1]) for p in (tmp_path / "rollouts").glob("step_*"))
    assert kept and kept[-1] == steps - 1 and kept[0] >= records[-1]["policy/step"] - 1


def test_no_waiting_within_the_bound_when_the_trainer_keeps_up(tmp_path):
    _, _, _, _, records, _ = run_orchestrator_with_trainer(tmp_path, k=2, steps=6, train_s=0.0, gen_delay=0.05)
    assert all(r["time/wait_weights"] < 0.15 for r in records)
    assert all(r["off_policy/level"] <= 2 for r in records)
    assert max(r["policy/step"] for r in records) >= 3  # it does pick up newer weights as they appear


@pytest.mark.parametrize("k", [1, 3])
def test_exactly_k_samples_k_steps_behind_a_trainer_that_keeps_up(tmp_path, k):
    """A trainer with no training time would let `at_most` take the newest weights (the test above); `exactly`
    takes policy n-k at every step, so each step's staleness is what k says."""
    _, server, _, _, records, metas = run_orchestrator_with_trainer(
        tmp_path, k, steps=6, train_s=0.0, gen_delay=0.05, async_lag="exactly"
    )
    assert [r["policy/step"] for r in records] == [max(n - k, 0) for n in range(6)]
    assert [r["off_policy/level"] for r in records] == [min(n, k) for n in range(6)]
    assert all(max(int(lag) for lag in metas[n]["staleness"]) == min(n, k) for n in range(6))
    updated = [int(path.rsplit("_", 1)[1]) for kind, path, _ in server.calls if kind == "update"]
    assert updated == list(range(1, 6 - k))


def test_gate_exactly_takes_the_oldest_policy_of_the_window(tmp_path):
    gate = PolicyGate(RunLayout(tmp_path), max_async_level=2, exactly=True)
    assert gate.newest(2) == Policy(0, None)
    for step in (1, 2, 3):
        publish(tmp_path, step)
    assert gate.newest(2) == Policy(0, None)  # the base model, though policies 1 and 2 exist
    assert gate.newest(3).step == 1 and gate.newest(5).step == 3
    assert gate.newest(6) is None  # waits for policy 4
    RunLayout(tmp_path).prune_broadcast(keep_from_step=3)  # a resumed run whose window starts in pruned dirs
    assert gate.newest(4).step == 3  # the oldest there is


def test_gate_picks_newest_policy_in_window(tmp_path):
    gate = PolicyGate(RunLayout(tmp_path), max_async_level=2)
    assert gate.newest(0) == Policy(0, None) and gate.newest(2) == Policy(0, None)
    assert gate.newest(3) is None  # needs policy >= 1
    publish(tmp_path, 1)
    (RunLayout(tmp_path).broadcast_dir(2)).mkdir(parents=True)  # not STABLE yet: ignored
    assert gate.newest(3).step == 1
    publish(tmp_path, 2)
    assert gate.newest(3).step == 2 and gate.newest(4).step == 2
    assert gate.newest(5) is None
    assert gate.newest(1).step == 1  # newer than the base model is fine within [n-k, n]
    with pytest.raises(TimeoutError, match="trainer"):
        asyncio.run(gate.wait(5, poll=0.01, timeout=0.05))


def test_gate_uses_checkpoint_weights_only_for_the_resume_step(tmp_path):
    from asyncrl.orchestrator.gating import checkpoint_policy

    d = RunLayout(tmp_path).weights_dir(10)
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    stale = RunLayout(tmp_path).weights_dir(20)
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")
    resume = checkpoint_policy(RunLayout(tmp_path), 10)
    gate = PolicyGate(RunLayout(tmp_path), 2, resume_policy=resume)
    assert gate.newest(10).path == d and gate.newest(12).step == 10
    assert gate.newest(13) is None  # weights/step_20 from an earlier run is never used
    assert checkpoint_policy(RunLayout(tmp_path), 11) is None
