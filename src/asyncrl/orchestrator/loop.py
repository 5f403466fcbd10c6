"""The orchestrator's main loop: per step, pick weights, generate, score, pack, write the batch.

Step n (0-based): wait for a policy >= n-k in the trainer's broadcast dirs (k = max_async_level;
n-k <= 0 allows the base model), tell the server to load it if it is newer than what it holds, run
online eval when due, collect the step's rollout groups (`rollouts.py`), pack them with their advantages
into micro-batches and write `rollouts/step_n` atomically (`batches.py`), then log the step's row
(`metrics.step_record`). The loop then goes straight on to step n+1 while the trainer trains on step n, so
generation and training overlap within the bound. `update_weights` is only ever sent between two steps'
generations (nothing is in flight then). The process around the loop is `process.py`; the throughput mode
(`--bench`) is `throughput.py`.

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
from pathlib import Path
from typing import Any

from loguru import logger

from asyncrl.config.orchestrator import OrchestratorConfig
from asyncrl.core.errors import UserError
from asyncrl.orchestrator import ckpt
from asyncrl.orchestrator.batches import TrainerRanks, step_items, write_step_batch
from asyncrl.orchestrator.client import InferenceClient, start_hint
from asyncrl.orchestrator.envs.mixture import EnvMixture
from asyncrl.orchestrator.envs.runners import RunGroup, sampling_args
from asyncrl.orchestrator.evaluation import evaluate_policy
from asyncrl.orchestrator.filtering import Group
from asyncrl.orchestrator.gating import Policy, PolicyGate, checkpoint_policy
from asyncrl.orchestrator.metrics import StepFacts, distill_record, log_extras, log_samples, log_step, step_record
from asyncrl.orchestrator.rollouts import GroupCollector, RolloutFailure, StepRollouts, gather_all, step_shape
from asyncrl.orchestrator.samples import Rollout, TrajectoryConverter
from asyncrl.orchestrator.teacher import PROBE, TeacherClient
from asyncrl.transport import fingerprint
from asyncrl.transport.layout import ADAPTER, RunLayout
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
        *,
        layout: RunLayout,
        eval_mixture: EnvMixture | None = None,
        sink: MetricsSink | None = None,
        teacher: TeacherClient | None = None,
    ):
        self.config = config
        self.teacher = teacher
        self.layout = layout
        self.mixture = mixture
        self.eval_mixture = eval_mixture
        self.run_group = run_group
        self.server = server
        self.served_model = config.model.name  # what requests name: the base model, or the run's LoRA adapter
        self.sink = sink or MetricsSink(self.layout, "orchestrator", config.wandb, config.model_dump(mode="json"))
        self.converter = TrajectoryConverter(config.trajectory_strategy)
        self.problems, self.in_flight = step_shape(config)
        self.collector = GroupCollector(
            mixture,
            run_group,
            self.converter,
            config.rollouts_per_example,
            config.buffer,
            config.advantage,
            fail_limit=max(4, 2 * self.in_flight),
            scorer=teacher.score_group if teacher is not None else None,
        )
        self.args = sampling_args(config.sampling)
        self.progress = ckpt.Progress()
        self.loaded_policy: int | None = None  # unknown until we set it
        self._context_warned_at: int | None = None
        self.ranks = TrainerRanks(config, self.layout)

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
            loaded = await self.server.load_lora_adapter(lora, policy.path / ADAPTER)
            self._verify(policy.step, policy.path / ADAPTER, loaded)
            self.served_model = lora
        else:
            self._verify(policy.step, policy.path, await self.server.update_weights(policy.path))
        self.loaded_policy = policy.step
        if self.teacher is not None and self.teacher.student is not None:
            self.teacher.student.model = self.served_model  # the baseline's scores name what the rollouts name
        logger.debug(f"server now serves policy {policy.step} ({policy.path or 'base model'})")
        return time.perf_counter() - start

    def _verify(self, step: int, published_dir: Path, loaded: dict[str, str] | None) -> None:
        """Stop before sampling when the server loaded other tensors than the trainer published (fingerprints)."""
        if (differs := fingerprint.mismatch(published_dir, loaded)) is not None:
            raise UserError(
                f"policy step {step}: the inference server at {self.server.root} loaded other weights than the "
                f"trainer published in {published_dir}: {differs}; they changed on the way (disk, copy) or the "
                "engine did not apply them: see the server's log, delete the dir and resume (the trainer "
                "publishes it again)"
            )

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
        got = gen.got
        await self.collector.await_scores(got)
        t_pack = time.perf_counter()
        items = step_items(got.groups, self.config)
        oldest = min(g.policy_step for g in got.groups)
        per_rank, stats = write_step_batch(
            self.layout, self.config, gen.step, items, self.ranks.learn(), (gen.policy.step, oldest)
        )
        t_write = time.perf_counter() - t_pack
        self.progress.advance(gen.step, stats.num_tokens, stats.num_samples, len(got.groups), gen.sampler)
        distill = distill_record(got, items) if self.teacher is not None else {}
        facts = StepFacts(
            gen.step,
            gen.policy.step,
            stats,
            len(per_rank[0]),
            self.mixture.metrics(),
            self.converter.fallbacks,
            distill,
            gen.waited,
            gen.t_update,
            t_write,
            time.perf_counter() - gen.t0,
        )
        buffer = self.config.buffer
        record = step_record(got, facts, (buffer.easy_threshold, buffer.hard_threshold), self.progress)
        self._log(gen.step, record, [r for g in got.groups for r in g.valid])
        self._checkpoint(gen.buffer)
        return record

    def _log(self, step: int, record: dict[str, Any], used: list[Rollout]) -> None:
        """The step's row, its warnings, its W&B extras and its best and worst rollout."""
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

    def _checkpoint(self, buffer: list[Group]) -> None:
        """Save the orchestrator's checkpoint when due (every `ckpt.interval` steps and at the last)."""
        cfg, p = self.config.ckpt, self.progress
        if cfg is not None and (p.step % cfg.interval == 0 or p.step == self.config.max_steps):
            path = ckpt.save(self.layout, p, buffer)
            ckpt.prune(self.layout, cfg)
            logger.info(f"saved orchestrator checkpoint {path}")

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
        gate = PolicyGate(self.layout, self.config.max_async_level, resume_policy, self.config.async_lag == "exactly")
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
