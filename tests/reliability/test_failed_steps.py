"""A step whose rollouts failed (issue 46, case 11): what the orchestrator trains on, and when it stops.

The decision (docs/reliability.md): a group whose every rollout failed is never trained on; the collector
draws new prompts in its place, so a step is made of groups that ran. An env-server restart that voids every
episode in flight (16 groups of 8 here, 128 rollouts, as in the report) costs those draws, not the step. When
groups keep failing completely (`2 x in_flight` in a row), or a step gets no usable group within its draws,
the orchestrator stops with the last error: no step is counted on nothing.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "orchestrator"))
from orch_fakes import FakeRunner, fake_mixture  # noqa: E402

from asyncrl.config.orchestrator import AdvantageConfig, BufferConfig  # noqa: E402
from asyncrl.orchestrator.rollouts import GroupCollector, RolloutFailure  # noqa: E402
from asyncrl.orchestrator.samples import TrajectoryConverter  # noqa: E402

pytestmark = pytest.mark.reliability
GROUPS, N = 16, 8
LOST = "EnvServerError: env server for environment a died (exit code -9; log env-server-a.log)"


def _collect(runner, fail_limit: int = 2 * GROUPS):
    collector = GroupCollector(
        fake_mixture(n_rows=500), runner, TrajectoryConverter(), N, BufferConfig(), AdvantageConfig(), fail_limit
    )
    return asyncio.run(collector.collect(0, 0, 1, GROUPS, GROUPS, {}))


class Restart:
    """The first `lost` groups' episodes fail as their env server dies under them; the rest run."""

    def __init__(self, lost: int):
        self.lost, self.calls, self.runner = lost, 0, FakeRunner()

    async def __call__(self, slot, inputs, args):
        self.calls += 1
        if self.calls <= self.lost:
            raise RuntimeError(LOST)
        return await self.runner(slot, inputs, args)


def test_a_step_whose_episodes_in_flight_all_fail_trains_on_redrawn_groups_only():
    got = _collect(Restart(lost=GROUPS))
    failed = [g for g in got.finished if g.verdict == "failed"]
    assert len(failed) == GROUPS and sum(len(g.rollouts) for g in failed) == GROUPS * N  # 128 voided
    assert len(got.groups) == GROUPS and all(g.verdict == "accept" and not g.num_errors for g in got.groups)
    assert not {id(g) for g in got.groups} & {id(g) for g in failed}


def test_groups_that_keep_failing_stop_the_run_with_the_cause_instead_of_a_step():
    with pytest.raises(RolloutFailure, match="32 rollout groups in a row failed completely; last error: RuntimeError"):
        _collect(Restart(lost=10_000))
    with pytest.raises(RolloutFailure, match=r"step 0: no usable rollout group after 128 tries"):
        _collect(Restart(lost=10_000), fail_limit=10_000)
