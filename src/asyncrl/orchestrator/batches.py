"""A step's training batch: every sample with its advantages, packed for the trainer's ranks, written.

A sample's advantage is its rollout's, times `reward_weight` (exactly the rollout's at weight 1). With a
teacher the sample carries the teacher's scores (`TokenSample.teacher`) and gets per-token advantages
(`advantage.token_advantages`), or with forward_kl the teacher's targets (`advantage.teacher_targets`) and the
reward's term only. The batch is packed for the trainer's rank count as it stands at that step
(`TrainerRanks`) and written atomically as `rollouts/step_n`; the batches of steps older than the policy it was
generated with are pruned (the trainer has consumed them). Each sample is stamped with the policy that produced
it (its group's: a request never spans a weight update, since updates land between steps and a step's
requests still running at its end are cancelled); `meta.json` holds the oldest stamp and the samples per lag.
"""

from __future__ import annotations

from collections import Counter

from loguru import logger

from asyncrl.config.orchestrator import OrchestratorConfig
from asyncrl.orchestrator.advantage import teacher_targets, token_advantages
from asyncrl.orchestrator.filtering import Group
from asyncrl.orchestrator.packing import PackItem, PackStats, pack
from asyncrl.orchestrator.samples import Rollout, TokenSample
from asyncrl.transport.batch import write_batch
from asyncrl.transport.layout import RunLayout, trainer_world_size
from asyncrl.transport.row import Row


def step_items(groups: list[Group], config: OrchestratorConfig) -> list[PackItem]:
    """The samples of the groups' valid rollouts, in order, each with its advantages (module docstring)."""
    return [
        sample_item(s, r, i, config, g.policy_step) for i, g in enumerate(groups) for r in g.valid for s in r.samples
    ]


def sample_item(
    sample: TokenSample, rollout: Rollout, group: int, config: OrchestratorConfig, policy_step: int
) -> PackItem:
    rw = config.reward_weight
    advantage = rollout.advantage if rw == 1.0 else rw * rollout.advantage
    item = PackItem(sample, advantage, config.sampling.temperature, group=group, policy_step=policy_step)
    if sample.teacher is not None:
        distill_item(item, rollout.advantage, config)
    return item


def distill_item(item: PackItem, advantage: float, config: OrchestratorConfig) -> None:
    """The teacher's signal on `item`: per-token advantages, and with forward_kl the trainer's targets (whose
    cross-entropy term then carries the teacher, so the advantages keep the reward's term only)."""
    s, scores, dw = item.sample, item.sample.teacher, config.distill_weight
    if scores.top is not None:
        item.teacher_targets = teacher_targets(s.loss_mask, scores.top, dw)
    distill = 0.0 if scores.top is not None else dw
    item.token_advantages = token_advantages(
        s.loss_mask,
        s.logprobs,
        scores.logprobs,
        advantage,
        distill,
        config.reward_weight,
        scores.baseline,
        config.distill.clip,
    )


class TrainerRanks:
    """The trainer's rank count: `num_train_workers`, else what trainer rank 0 writes at start (read every step:
    a trainer that starts later, or again with another world size, is followed), else 1. A batch packed for
    another count still trains: the trainer deals its rows out again."""

    def __init__(self, config: OrchestratorConfig, layout: RunLayout):
        self.fixed, self.layout, self.count = config.num_train_workers, layout, 0

    def learn(self) -> int:
        if self.fixed is not None:
            self.count = self.fixed
            return self.count
        path, written = self.layout.trainer_world, trainer_world_size(self.layout)
        ranks = written or 1
        if ranks != self.count:
            said = f"from {path}" if written else f"until the trainer writes {path.name}"
            logger.info(f"packing batches for {ranks} trainer rank(s) ({said})")
        self.count = ranks
        return ranks


def write_step_batch(
    layout: RunLayout, config: OrchestratorConfig, step: int, items: list[PackItem], ranks: int, policy: tuple[int, int]
) -> tuple[list[list[Row]], PackStats]:
    """Pack `items` for `ranks` trainer ranks and write them as step `step`'s batch; `policy`: (the policy the
    step was generated with, the oldest policy among its groups)."""
    per_rank, stats = pack(items, config.seq_len, ranks, share=config.share_prefix)
    meta = {
        "num_samples": stats.num_samples,
        "num_tokens": stats.num_tokens,
        "num_tokens_unshared": stats.num_tokens_unshared,
        "policy_step": policy[0],
        "min_policy_step": policy[1],
        "staleness": {str(lag): n for lag, n in sorted(Counter(step - item.policy_step for item in items).items())},
    }
    write_batch(layout, step, per_rank, meta)
    if policy[0] > 0:
        layout.prune_batches(keep_from_step=policy[0])  # the trainer has consumed those
    return per_rank, stats
