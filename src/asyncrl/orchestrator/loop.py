"""The orchestrator's main loop: per step, pick weights, generate, score, pack, write the batch.

Step n (0-based): wait for a policy >= n-k in the trainer's broadcast dirs (k = max_async_level;
n-k <= 0 allows the base model), tell the server to load it if it is newer than what it holds, run
online eval when due, collect the step's rollout groups, compute advantages, pack them into
micro-batches and write `rollouts/step_n` atomically. The loop then goes straight on to step n+1
while the trainer trains on step n, so generation and training overlap within the bound.
`update_weights` is only ever sent between two steps' generations (nothing is in flight then).

With a teacher (on-policy distillation), the teacher is checked at every start (a resumed run too), each
accepted group is scored by it while the step's other groups generate, and the batch's advantages are per
token (advantage.token_advantages); the step logs `distill/teacher_kl`, `distill/teacher_lp` and
`time/teacher_s` (the wait for scores after the rollouts were done). That wait overlaps the next step's
generation (`overlaps_scoring`): step n+1 starts generating as soon as step n's rollouts are done, while
step n is scored, packed and written; batches are still written in step order, at most one step is finishing
at a time, and a checkpoint holds the buffer and sampler state of when its step's rollouts were done. Step
n+1's weights gate needs batch n-k trained: written already for k >= 1, the one finishing alongside for
k = 0, so this never deadlocks. `time/step` is then a step's latency (start to batch written), and steps
overlap by up to the scoring wait.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

from loguru import logger

from asyncrl.config.orchestrator import OrchestratorConfig
from asyncrl.core.errors import UserError
from asyncrl.orchestrator import ckpt
from asyncrl.orchestrator.advantage import teacher_targets, token_advantages
from asyncrl.orchestrator.client import InferenceClient, start_hint
from asyncrl.orchestrator.envs.mixture import EnvMixture
from asyncrl.orchestrator.envs.runners import RunGroup, runners_for, sampling_args
from asyncrl.orchestrator.evaluation import evaluate_policy
from asyncrl.orchestrator.filtering import Group
from asyncrl.orchestrator.gating import Policy, PolicyGate, checkpoint_policy
from asyncrl.orchestrator.metrics import (
    distill_metrics,
    group_metrics,
    log_extras,
    log_samples,
    log_step,
    rollout_metrics,
)
from asyncrl.orchestrator.packing import PackItem, PackStats, pack
from asyncrl.orchestrator.rollouts import (
    GroupCollector,
    RolloutFailure,
    StepRollouts,
    gather_all,
    in_flight_target,
    problems_per_step,
)
from asyncrl.orchestrator.samples import TrajectoryConverter
from asyncrl.orchestrator.teacher import PROBE, TeacherClient, with_student
from asyncrl.transport.batch import MicroBatch, write_batch
from asyncrl.transport.layout import ADAPTER, RunLayout, trainer_world_size
from asyncrl.transport.weights import weights_problem
from asyncrl.utils.monitor import MetricsSink, drop_rows_from


@dataclass
class Generated:
    """A step whose rollouts are done: what `_finish` needs to score, pack, write and checkpoint it."""

    step: int
    t0: float
    policy: Policy
    waited: float
    t_update: float
    got: StepRollouts
    buffer: list[Group]  # the collector's buffer when the rollouts were done (what the step's checkpoint holds)
    sampler: dict  # the env sampler's state then


async def alongside(work: Awaitable, finishing: asyncio.Future | None) -> Any:
    """`work`'s result, with the previous step's finishing (if any) done too; the first to fail cancels the other."""
    if finishing is None:
        return await work
    return (await gather_all([work, finishing]))[0]


class Orchestrator:
    def __init__(
        self,
        config: OrchestratorConfig,
        mixture: EnvMixture,
        run_group: RunGroup,
        server: InferenceClient,
        eval_mixture: EnvMixture | None = None,
        sink: MetricsSink | None = None,
        layout: RunLayout | None = None,
        teacher: TeacherClient | None = None,
    ):
        self.config = config
        self.teacher = teacher
        self.layout = layout or RunLayout.for_config(config)
        self.mixture = mixture
        self.eval_mixture = eval_mixture
        self.run_group = run_group
        self.server = server
        self.served_model = config.model.name  # what requests name: the base model, or the run's LoRA adapter
        self.sink = sink or MetricsSink(self.layout, "orchestrator", config.wandb, config.model_dump(mode="json"))
        self.converter = TrajectoryConverter(config.trajectory_strategy)
        self.problems = problems_per_step(config.batch_size, config.rollouts_per_example)
        target = in_flight_target(self.problems, config.oversampling_factor)
        if config.max_concurrent is not None:
            target = max(1, min(target, config.max_concurrent // config.rollouts_per_example))
        self.in_flight = target
        self.collector = GroupCollector(
            mixture,
            run_group,
            self.converter,
            config.rollouts_per_example,
            config.buffer,
            config.advantage,
            fail_limit=max(4, 2 * target),
            scorer=teacher.score_group if teacher is not None else None,
        )
        self.args = sampling_args(config.sampling)
        self.progress = ckpt.Progress()
        self.loaded_policy: int | None = None  # unknown until we set it
        self._context_warned_at: int | None = None
        self._trainer_ranks = 0  # known before the first batch is packed

    # ---- setup -------------------------------------------------------------------------------
    def _resume(self) -> Policy | None:
        cfg = self.config
        if cfg.ckpt is None or cfg.ckpt.resume_step is None:
            return None
        step = ckpt.resolve_resume_step(self.layout, cfg.ckpt.resume_step)
        if step == 0:
            return None
        self.progress, self.collector.buffer = ckpt.load(self.layout, step)
        try:
            self.mixture.load_state(self.progress.sampler)
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            path = self.layout.checkpoint_dir(step, ckpt.COMPONENT) / ckpt.PROGRESS
            raise UserError(
                f"orchestrator checkpoint {path} is corrupted: its sampler state is unreadable "
                f"({type(e).__name__}: {e}); resume from another step"
            ) from None
        logger.info(
            f"resuming at step {step} ({self.progress.total_samples} samples so far, "
            f"{len(self.collector.buffer)} buffered groups)"
        )
        return checkpoint_policy(self.layout, step)

    # ---- per step ----------------------------------------------------------------------------
    async def _use_policy(self, policy: Policy) -> float:
        if policy.step == self.loaded_policy:
            return 0.0
        start = time.perf_counter()
        lora = self.config.lora_name
        if policy.path is not None and (problem := weights_problem(policy.path)) is not None:
            raise UserError(
                f"the weights of policy step {policy.step} are damaged: {problem}; delete {policy.path} and resume "
                "(the trainer publishes a step's weights again from its checkpoint), or resume from an earlier step"
            )
        if policy.is_base:
            if lora is None:  # an adapter run never changes the base weights (others may be serving them)
                await self.server.reload_weights()
            self.served_model = self.config.model.name
        elif lora is not None:
            await self.server.load_lora_adapter(lora, policy.path / ADAPTER)
            self.served_model = lora
        else:
            await self.server.update_weights(policy.path)
        self.loaded_policy = policy.step
        if self.teacher is not None and self.teacher.student is not None:
            self.teacher.student.model = self.served_model  # the baseline's scores name what the rollouts name
        logger.debug(f"server now serves policy {policy.step} ({policy.path or 'base model'})")
        return time.perf_counter() - start

    async def _maybe_eval(self, step: int) -> None:
        ev = self.config.eval
        if ev is None or self.eval_mixture is None or step % ev.interval or (step == 0 and not ev.eval_base):
            return
        await self._eval(step)

    async def _final_eval(self, end: int) -> None:
        """Evaluate the trained policy of the last step (`broadcast/step_{end}`), logged as eval step `end`."""
        ev = self.config.eval
        if ev is None or self.eval_mixture is None or not ev.eval_final:
            return
        policy, _ = await PolicyGate(self.layout, 0).wait(end, timeout=self.config.weights_timeout)
        await self._use_policy(policy)
        await self._eval(end)

    async def _eval(self, step: int) -> None:
        ev = self.config.eval
        metrics = await evaluate_policy(
            self.eval_mixture,
            self.run_group,
            TrajectoryConverter(self.config.trajectory_strategy),
            ev.num_examples,
            ev.rollouts_per_example,
            sampling_args(self.config.sampling, True),
            self.in_flight,
        )
        record = {"kind": "eval", "step": step, "policy/step": self.loaded_policy, **metrics}
        logger.info(
            f"eval step {step} (policy {self.loaded_policy}): reward {metrics.get('eval/reward/mean', 0.0):.3f} "
            f"over {int(metrics['eval/rollouts'])} rollouts in {metrics['eval/seconds']:.1f}s"
        )
        self.sink.log(step, {k: v for k, v in record.items() if k != "step"})

    async def _connect_teacher(self) -> None:
        """Check the teacher (health, key, model, same tokenizer as the student's server): at every start."""
        if self.teacher is None:
            return
        answer = await self.server.tokenize(self.config.model.name, PROBE)
        await self.teacher.connect(answer.get("tokens"), self.config.model.name, answer.get("vocab_size"))
        if self.config.buffer.online_difficulty_filtering:
            logger.info("distillation: online_difficulty_filtering keeps every group (each has the teacher's signal)")

    def _items(self, got: StepRollouts) -> list[PackItem]:
        """The step's samples with their advantages: the reward's (times reward weight), or per token with a
        teacher. Without a teacher and at reward weight 1 these are exactly the reward's advantages."""
        temperature = self.config.sampling.temperature
        dw, rw = self.config.distill_weight, self.config.reward_weight
        items = []
        for i, g in enumerate(got.groups):
            scores = iter(got.teacher[i]) if got.teacher is not None else None
            for r in g.valid:
                for s in r.samples:
                    item = PackItem(s, r.advantage if rw == 1.0 else rw * r.advantage, temperature, group=i)
                    if scores is not None:
                        lps = next(scores)
                        top = getattr(lps, "top", None)
                        if top is not None:  # forward_kl: the trainer's cross-entropy term carries the teacher
                            item.teacher_targets = teacher_targets(s.loss_mask, top, dw)
                        baseline = getattr(lps, "baseline", None)
                        item.token_advantages = token_advantages(
                            s.loss_mask,
                            s.logprobs,
                            lps,
                            r.advantage,
                            0.0 if top is not None else dw,
                            rw,
                            baseline,
                            self.config.distill.clip,
                        )
                    items.append(item)
        return items

    def _pack(self, items: list[PackItem]) -> tuple[list[list[MicroBatch]], PackStats]:
        return pack(items, self.config.seq_len, self._trainer_ranks, share=self.config.share_prefix)

    def _learn_trainer_ranks(self) -> None:
        """The trainer's rank count: `num_train_workers`, else what trainer rank 0 writes at start (read every
        step: a trainer that starts later, or again with another world size, is followed), else 1. A batch
        packed for another count still trains: the trainer deals its rows out again."""
        if self.config.num_train_workers is not None:
            self._trainer_ranks = self.config.num_train_workers
            return
        path, written = self.layout.trainer_world, trainer_world_size(self.layout)
        ranks = written or 1
        if ranks != self._trainer_ranks:
            said = f"from {path}" if written else f"until the trainer writes {path.name}"
            logger.info(f"packing batches for {ranks} trainer rank(s) ({said})")
        self._trainer_ranks = ranks

    @property
    def overlaps_scoring(self) -> bool:
        """Whether a step's teacher scoring may run on while the next step generates: with a teacher that is
        not the student's own server and asks nothing of it (a baseline scores on the student's server, which
        must not change weights under it)."""
        t = self.teacher
        return t is not None and t.student is None and t.root != self.server.root

    async def _generate(self, step: int, gate: PolicyGate) -> Generated:
        t0 = time.perf_counter()
        policy, waited = await gate.wait(step, timeout=self.config.weights_timeout)
        if waited > 0.05:
            logger.debug(f"step {step}: waited {waited:.2f}s for trainer weights (policy {policy.step})")
        t_update = await self._use_policy(policy)
        await self._maybe_eval(step)
        got = await self.collector.collect(
            step, policy.step, self.config.max_async_level, self.problems, self.in_flight, self.args
        )
        # what a checkpoint of this step holds, as it stands before the next step draws and buffers
        return Generated(step, t0, policy, waited, t_update, got, list(self.collector.buffer), self.mixture.state())

    async def _finish(self, gen: Generated) -> dict[str, Any]:
        """Wait for the step's teacher scores, pack and write its batch, log it, checkpoint when due."""
        step, policy, got = gen.step, gen.policy, gen.got
        await self.collector.await_scores(got)
        min_policy = min(g.policy_step for g in got.groups)
        self._learn_trainer_ranks()
        t_pack = time.perf_counter()
        items = self._items(got)
        per_rank, stats = self._pack(items)
        meta = {
            "num_samples": stats.num_samples,
            "num_tokens": stats.num_tokens,
            "num_tokens_unshared": stats.num_tokens_unshared,
            "policy_step": policy.step,
            "min_policy_step": min_policy,
        }
        write_batch(self.layout, step, per_rank, meta)
        if policy.step > 0:
            self.layout.prune_batches(keep_from_step=policy.step)  # the trainer has consumed those
        t_write = time.perf_counter() - t_pack

        p = self.progress
        p.step = step + 1
        p.total_tokens += stats.num_tokens
        p.total_samples += stats.num_samples
        p.total_problems += len(got.groups)
        p.sampler = gen.sampler
        used = [r for g in got.groups for r in g.valid]
        gen_tokens = sum(r.completion_len for g in got.finished for r in g.valid)
        gen_rollouts = sum(len(g.valid) for g in got.finished)
        record: dict[str, Any] = {
            "kind": "train",
            "step": step,
            **rollout_metrics(used),
            **self.mixture.metrics(),
            **group_metrics(
                got.groups, got.finished, self.config.buffer.easy_threshold, self.config.buffer.hard_threshold
            ),
            "policy/step": policy.step,
            "off_policy/level": step - min_policy,
            "batch/samples": stats.num_samples,
            "batch/tokens": stats.num_tokens,
            "batch/tokens_unshared": stats.num_tokens_unshared,
            "batch/shared_frac": 1 - stats.num_tokens / max(stats.num_tokens_unshared, 1),
            "batch/loss_tokens": stats.num_loss_tokens,
            "batch/truncated_samples": stats.num_truncated,
            "batch/micro_batches": len(per_rank[0]),
            "batch/dummy_micro_batches": stats.num_dummies,
            "groups/launched": got.launched,
            "groups/cancelled": got.cancelled,
            "groups/reused": got.reused,
            "groups/stale_dropped": got.stale_dropped,
            "groups/filler": got.filler,
            "trajectory/prefix_fallbacks_total": self.converter.fallbacks,
            "perf/gen_tokens_per_s": gen_tokens / max(got.seconds, 1e-9),
            "perf/rollouts_per_s": gen_rollouts / max(got.seconds, 1e-9),
            "time/wait_weights": gen.waited,
            "time/update_weights": gen.t_update,
            "time/rollouts": got.seconds,
            **self._distill_record(got, items),
            "time/pack_write": t_write,
            "time/step": time.perf_counter() - gen.t0,
            "progress/total_tokens": p.total_tokens,
            "progress/total_samples": p.total_samples,
            "progress/total_problems": p.total_problems,
        }
        log_step(self.sink, record)
        if record["rollouts/errors"]:
            logger.warning(
                f"step {step}: {int(record['rollouts/errors'])} rollouts failed and were masked out "
                f"(last error: {self.collector.last_error})"
            )
        self._warn_context_full(step, record["context_full/frac"])
        log_extras(self.sink, step, used)
        if self.sink.enabled:
            log_samples(self.layout.samples, step, used)
        cfg = self.config.ckpt
        if cfg is not None and (p.step % cfg.interval == 0 or p.step == self.config.max_steps):
            path = ckpt.save(self.layout, p, gen.buffer)
            ckpt.prune(self.layout, cfg)
            logger.info(f"saved orchestrator checkpoint {path}")
        return record

    def _distill_record(self, got: StepRollouts, items: list[PackItem]) -> dict[str, float]:
        if got.teacher is None:
            return {}
        record = distill_metrics([it.sample for it in items], [lp for per_group in got.teacher for lp in per_group])
        record["time/teacher_s"] = got.teacher_seconds
        # a rollout is effective when any of its tokens moves the policy (reward or teacher)
        record["batch/effective_rollouts"] = float(
            sum(any(abs(a) > 1e-8 for a in it.token_advantages or []) for it in items)
        )
        return record

    def _warn_context_full(self, step: int, frac: float) -> None:
        """Rollouts cut short by a full context silently lose their later turns (and usually their reward)."""
        if frac == 0 or (self._context_warned_at is not None and step - self._context_warned_at < 10):
            return
        self._context_warned_at = step
        logger.warning(
            f"step {step}: {frac:.0%} of rollouts ended early because their next turn did not fit the context "
            f"(prompt so far + sampling.max_tokens = {self.config.sampling.max_tokens} > the server's max_model_len, "
            f"which rl sets to seq_len = {self.config.seq_len}); raise seq_len or lower sampling.max_tokens "
            "(metric context_full/frac)"
        )

    async def run(self) -> None:
        resume_policy = self._resume()
        start = self.progress.step
        self.layout.clear_stale(start)
        self.sink.restart_at(start)
        drop_rows_from(self.layout.samples, start)
        gate = PolicyGate(self.layout, self.config.max_async_level, resume_policy)
        if self.config.sampling.seed is not None:
            logger.info(
                "sampling.seed is used for eval requests only (a shared seed would make a group's rollouts identical)"
            )
        end = self.config.max_steps
        logger.info(
            f"orchestrator: steps {start}..{'' if end is None else end - 1}, {self.problems} prompts x "
            f"{self.config.rollouts_per_example} rollouts per step, async level {self.config.max_async_level}"
        )
        step, finishing = start, None
        try:
            await self._connect_teacher()
            while end is None or step < end:
                generated = await alongside(self._generate(step, gate), finishing)
                finishing = asyncio.ensure_future(self._finish(generated))
                if not self.overlaps_scoring:
                    await finishing
                step += 1
            if finishing is not None:
                await finishing
            if end is not None:
                await self._final_eval(end)
        except RolloutFailure as e:
            if not await self.server.is_healthy():
                raise UserError(
                    f"rollouts failed because the inference server at {self.server.root} stopped "
                    f"answering; {start_hint(self.server.url)}"
                ) from e
            raise UserError(  # the model's or the environment's doing, not a bug here: one line, in the log
                f"step {step}: {e}; the server answers, so the environment or the policy's replies fail (a policy "
                "that collapsed to empty replies: lower the learning rate, resume from an earlier checkpoint)"
            ) from e
        finally:
            if finishing is not None and not finishing.done():
                finishing.cancel()
                await asyncio.gather(finishing, return_exceptions=True)
            await self.collector.close()
            self.sink.close()
        logger.success(f"orchestrator finished {step - start} steps ({self.progress.total_samples} samples in total)")


def bench_record(row: dict) -> dict:
    """A bench step's metrics row (`kind` = "bench"), named as a run's step rows name the same numbers."""
    return {
        "kind": "bench",
        "rollouts": row["rollouts"],
        "errors": row["errors"],
        "time/rollouts": row["seconds"],
        "perf/rollouts_per_s": row["rollouts_per_s"],
        "perf/gen_tokens_per_s": row["gen_tokens_per_s"],
        "perf/total_tokens_per_s": row["total_tokens_per_s"],
    }


async def run_bench(
    config: OrchestratorConfig, mixture: EnvMixture, run_group: RunGroup, sink: MetricsSink | None = None
) -> list[dict]:
    """Generate a few batches against a running server (no weights, no batches written); print throughput and
    log each step to the metrics file (and W&B), as the trainer's --bench does."""
    from asyncrl.config.orchestrator import BufferConfig

    problems = problems_per_step(config.batch_size, config.rollouts_per_example)
    in_flight = in_flight_target(problems, config.oversampling_factor)
    if config.max_concurrent is not None:
        in_flight = max(1, min(in_flight, config.max_concurrent // config.rollouts_per_example))
    collector = GroupCollector(
        mixture,
        run_group,
        TrajectoryConverter(config.trajectory_strategy),
        config.rollouts_per_example,
        BufferConfig(),
        config.advantage,
        fail_limit=max(4, 2 * in_flight),
    )
    args = sampling_args(config.sampling)
    rows = []
    if sink is not None:
        sink.restart_at(0)
    for step in range(config.max_steps or 3):
        collector.buffer.clear()
        got = await collector.collect(step, 0, 0, problems, in_flight, args)
        valid = [r for g in got.finished for r in g.valid]
        completion = sum(r.completion_len for r in valid)
        total = sum(r.prompt_len + r.completion_len for r in valid)
        rows.append(
            {
                "step": step,
                "rollouts": len(valid),
                "seconds": got.seconds,
                "rollouts_per_s": len(valid) / got.seconds,
                "gen_tokens_per_s": completion / got.seconds,
                "total_tokens_per_s": total / got.seconds,
                "errors": sum(not r.ok for g in got.finished for r in g.rollouts),
            }
        )
        if sink is not None:
            sink.log(step, bench_record(rows[-1]))
    timed = rows[1:] or rows  # the first step includes connection warm-up
    secs = sum(r["seconds"] for r in timed)
    rollouts = sum(r["rollouts"] for r in timed)
    summary = {
        "step": "total",
        "rollouts": rollouts,
        "seconds": secs,
        "errors": sum(r["errors"] for r in timed),
        "rollouts_per_s": rollouts / secs,
        "gen_tokens_per_s": sum(r["gen_tokens_per_s"] * r["seconds"] for r in timed) / secs,
        "total_tokens_per_s": sum(r["total_tokens_per_s"] * r["seconds"] for r in timed) / secs,
    }
    print(
        f"orchestrator bench: {problems} prompts x {config.rollouts_per_example} rollouts per step, "
        f"max_tokens={config.sampling.max_tokens}, server {config.client.url}"
    )
    print(
        f"{'step':>5} {'rollouts':>9} {'seconds':>8} {'rollouts/s':>11} "
        f"{'gen tok/s':>10} {'total tok/s':>12} {'errors':>7}"
    )
    for r in rows + [summary]:
        print(
            f"{r['step']:>5} {r['rollouts']:>9} {r['seconds']:>8.2f} {r['rollouts_per_s']:>11.2f} "
            f"{r['gen_tokens_per_s']:>10.1f} {r['total_tokens_per_s']:>12.1f} {r['errors']:>7}"
        )
    if len(rows) > 1:
        print("(total: steps 1 and later; step 0 includes connection warm-up)")
    return rows + [summary]


async def orchestrate(config: OrchestratorConfig, run_group: RunGroup | None = None) -> None:
    """Load environments, connect to the server and run (or bench)."""
    mixture = EnvMixture.load(config.env, config.seq_len, config.seed)
    eval_mixture = None
    if config.eval is not None and not config.bench:
        eval_mixture = EnvMixture.load(config.eval.env or config.env, config.seq_len, config.seed, eval_split=True)
    server = InferenceClient(config.client)
    teacher = None
    if config.teacher is not None and not config.bench:
        teacher = with_student(config.teacher, config.seq_len, config.distill, config.client, config.model.name)
    runners = None
    try:
        await server.wait_healthy(timeout=config.client.health_timeout)
        await server.check_key()
        if run_group is None:
            name = config.model.name if config.bench else (lambda: orchestrator.served_model)
            slots = mixture.slots + (eval_mixture.slots if eval_mixture else [])
            logs = RunLayout.for_config(config).logs
            runners = runners_for(
                slots,
                config.client,
                config.model.name,
                name,
                renderer=config.renderer,
                log_dir=logs,
                direct=config.episodes == "direct",
            )
            run_group = runners.run_group
        if config.bench:
            layout = RunLayout.for_config(config)
            sink = MetricsSink(layout, "orchestrator", config.wandb, config.model_dump(mode="json"))
            try:
                await run_bench(config, mixture, run_group, sink)
            finally:
                sink.close()
        else:
            orchestrator = Orchestrator(config, mixture, run_group, server, eval_mixture, teacher=teacher)
            await orchestrator.run()
    finally:
        await server.close()
        if teacher is not None:
            await teacher.close()
        if runners is not None:
            await runners.close()


def run_orchestrator(config: OrchestratorConfig) -> None:
    """Entry point: run the orchestrator to completion (the entrypoint has set up logging)."""
    asyncio.run(orchestrate(config))
