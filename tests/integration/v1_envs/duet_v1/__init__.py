"""A two-agent verifiers v1 environment, for the tests: a `solver` answers the task, then a `critic` (not
trainable) is asked about the solver's answer in an exchange of two turns; `finalize` records a cross-agent
metric. Exercises several agents, `Env.setup` standing, interactions and finalize."""

from __future__ import annotations

import verifiers.v1 as vf


class DuetData(vf.TaskData):
    answer: str


class DuetTask(vf.Task[DuetData]):
    @vf.stop
    async def two_turns(self, trace: vf.Trace) -> bool:
        return trace.num_turns >= 2

    @vf.reward(weight=1.0)
    async def exact(self, trace: vf.Trace) -> float:
        return float((trace.last_reply or "").strip() == self.data.answer)


class DuetConfig(vf.EnvConfig):
    solver: vf.AgentConfig = vf.AgentConfig()
    critic: vf.AgentConfig = vf.AgentConfig()


class DuetEnv(vf.Env[DuetConfig]):
    async def setup(self, agents) -> None:
        agents.critic.trainable = False

    async def run(self, task, agents) -> None:
        solved = await agents.solver.run(task)
        data = DuetData(idx=task.data.idx, prompt=None, system_prompt="Judge briefly.", answer=task.data.answer)
        review = DuetTask(data, task.config)
        async with agents.critic.interaction(review) as exchange:
            await exchange.turn(f"Is '{solved.last_reply}' right for {task.data.answer}?")
            await exchange.turn("Say it once more.")

    async def finalize(self, task, episode) -> None:
        replies = {t.agent.name: (t.last_reply or "").strip() for t in episode.traces}
        for trace in episode.traces:
            trace.record_metric("agree", float(len(set(replies.values())) == 1))


class DuetTaskset(vf.Taskset[DuetTask, vf.TasksetConfig]):
    def load(self):
        for i, word in enumerate(["alpha", "beta", "gamma", "delta", "omega", "kappa"]):
            yield DuetTask(DuetData(idx=i, prompt=f"Say: {word}", answer=word), self.config.task)


__all__ = ["DuetEnv", "DuetConfig", "DuetTaskset"]
