"""A verifiers v1 taskset for the tests: reverse a short word, single turn, exact-match reward.

Its tasks are made here (no dataset download); the package exports its Taskset via `__all__`, as verifiers'
loader requires.
"""

import random

import verifiers.v1 as vf


class ReverseData(vf.TaskData):
    answer: str


class ReverseTask(vf.Task[ReverseData]):
    @vf.stop
    async def one_turn(self, trace: vf.Trace) -> bool:
        return trace.num_turns >= 1

    @vf.reward(weight=1.0)
    async def exact(self, trace: vf.Trace) -> float:
        return float((trace.last_reply or "").strip() == self.data.answer)


class ReverseTaskset(vf.Taskset[ReverseTask, vf.TasksetConfig]):
    def load(self):
        rng = random.Random(0)
        words = ["".join(rng.choice("abcdef") for _ in range(4)) for _ in range(8)]
        for i, word in enumerate(words):
            yield ReverseTask(ReverseData(idx=i, prompt=f"reverse: {word}", answer=word[::-1]), self.config.task)


__all__ = ["ReverseTaskset"]
