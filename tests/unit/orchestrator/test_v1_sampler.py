"""GroupSampler's batching (`orchestrator/envs/sampler.py`): the turns of one loop tick with the same prompt and
sampling go out as one n = k request, each turn gets its own choice; seeded or unmerged turns go alone; a
short answer fails every turn; a request whose turns are all cancelled is cancelled."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

pytest.importorskip("verifiers.v1")

from asyncrl.orchestrator.envs.sampler import GroupSampler  # noqa: E402


def sampler(merge: bool = True, answer=None) -> tuple[GroupSampler, list[dict]]:
    client = SimpleNamespace(base_url="http://127.0.0.1:1/v1", api_key_var=None)
    made = GroupSampler(client, merge=merge)
    posted: list[dict] = []

    async def post_json(body: dict) -> dict:
        posted.append(body)
        if answer is not None:
            return await answer(body)
        n = body["sampling_params"].get("n", 1)
        return {"choices": [{"index": i, "token_ids": [i]} for i in range(n)]}

    made.post_json = post_json
    return made, posted


def body(seed=None) -> dict:
    sp = {"temperature": 1.0, **({"seed": seed} if seed is not None else {})}
    return {"model": "m", "token_ids": [1, 2, 3], "sampling_params": sp}


def test_a_ticks_identical_turns_are_one_request_with_a_choice_each():
    made, posted = sampler()

    async def main():
        return await asyncio.gather(*(made.generate(body()) for _ in range(3)))

    got = asyncio.run(main())
    assert len(posted) == 1 and posted[0]["sampling_params"]["n"] == 3
    assert sorted(choice["token_ids"][0] for _, choice in got) == [0, 1, 2]
    assert (made.sent, made.turns) == (1, 3)


@pytest.mark.parametrize(("merge", "seed"), [(False, None), (True, 7)])
def test_seeded_or_unmerged_turns_go_alone(merge, seed):
    made, posted = sampler(merge=merge)

    async def main():
        return await asyncio.gather(*(made.generate(body(seed)) for _ in range(3)))

    asyncio.run(main())
    assert len(posted) == 3 and all("n" not in p["sampling_params"] for p in posted)


def test_a_short_answer_fails_every_turn_of_the_request():
    from verifiers.v1.errors import ProviderError

    async def short(body):
        return {"choices": [{"index": 0, "token_ids": [0]}]}

    made, _ = sampler(answer=short)

    async def main():
        return await asyncio.gather(*(made.generate(body()) for _ in range(2)), return_exceptions=True)

    got = asyncio.run(main())
    assert all(isinstance(e, ProviderError) and e.status_code == 502 for e in got), got


def test_a_request_whose_turns_are_all_cancelled_is_cancelled():
    stopped = []

    async def hang(body):
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            stopped.append(body)
            raise

    made, _ = sampler(answer=hang)

    async def main():
        turns = [asyncio.ensure_future(made.generate(body())) for _ in range(2)]
        await asyncio.sleep(0.01)
        turns[0].cancel()
        await asyncio.sleep(0.01)
        assert not stopped  # one turn still waits on it
        turns[1].cancel()
        await asyncio.sleep(0.01)

    asyncio.run(main())
    assert len(stopped) == 1
