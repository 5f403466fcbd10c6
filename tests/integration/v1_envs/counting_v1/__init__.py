"""A verifiers v1 taskset that never ends, for the tests: task i asks for the number i (single turn)."""

import itertools

import verifiers.v1 as vf


class CountData(vf.TaskData):
    answer: str


class CountTask(vf.Task[CountData]):
    @vf.stop
    async def one_turn(self, trace: vf.Trace) -> bool:
        return trace.num_turns >= 1

    @vf.reward(weight=1.0)
    async def exact(self, trace: vf.Trace) -> float:
        return float((trace.last_reply or "").strip() == self.data.answer)


class CountingTaskset(vf.Taskset[CountTask, vf.TasksetConfig]):
    def load(self):
        for i in itertools.count():
            yield CountTask(CountData(idx=i, prompt=f"say {i}", answer=str(i)), self.config.task)


__all__ = ["CountingTaskset"]
