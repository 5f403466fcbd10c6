"""`tune_for_episodes` changes what an episode costs, never what it does.

Each setting is checked for its effect (the training client's transport, the cached pydantic check, the
GC threshold) and for keeping behaviour: the same answers, a user's higher threshold kept, idempotence.
"""

from __future__ import annotations

import gc

import pytest
from pydantic import BaseModel, Field

from asyncrl.orchestrator.envs.http import AioHttpTransport
from asyncrl.orchestrator.envs.tuning import GC_YOUNG_THRESHOLD, tune_for_episodes


@pytest.fixture(autouse=True)
def thresholds():
    """Each test leaves the GC as it found it."""
    saved = gc.get_threshold()
    yield
    gc.set_threshold(*saved)


def test_the_training_client_sends_over_the_aiohttp_transport(monkeypatch):
    import verifiers.v1 as vf
    from verifiers.v1.clients import train

    monkeypatch.setenv("ASYNCRL_TUNING_KEY", "k")
    tune_for_episodes()
    config = vf.TrainClientConfig(base_url="http://127.0.0.1:1/v1", api_key_var="ASYNCRL_TUNING_KEY")
    client = train.build_async_openai(config)
    assert isinstance(client._client._transport, AioHttpTransport)
    assert client.api_key == "k" and str(client.base_url) == "http://127.0.0.1:1/v1/" and client.max_retries == 0
    build = train.build_async_openai
    tune_for_episodes()
    assert train.build_async_openai is build  # wrapped once


def test_default_factories_give_the_same_values_with_the_check_cached():
    def with_data(data: dict) -> list:
        return [data["a"]]

    class Node(BaseModel):
        a: int = 0
        ids: list[int] = Field(default_factory=list)
        echo: list[int] = Field(default_factory=with_data)

    tune_for_episodes()
    for _ in range(2):  # the second time from the cache
        node = Node.model_construct(a=3)
        assert node.ids == [] and node.echo == [3]
        assert Node(a=4).echo == [4]
    assert Node.model_construct(a=1).ids is not Node.model_construct(a=1).ids  # still a fresh list each time


def test_the_factory_check_cache_is_hit_by_verifiers_trace_nodes(monkeypatch):
    """What the cache is for: verifiers' `MessageNode.model_construct` (every trace node) asks pydantic's check
    for every field of every node without it, and once per distinct factory with it."""
    from pydantic._internal import _fields
    from verifiers.v1.graph import MessageNode

    from asyncrl.orchestrator.envs.tuning import cache_factory_check

    asked = []
    installed = _fields.takes_validated_data_argument
    upstream = getattr(installed, "__wrapped__", installed)  # another test may have cached it already

    def counted(factory) -> bool:
        asked.append(factory)
        return upstream(factory)

    def nodes(k: int) -> int:
        before = len(asked)
        for i in range(k):
            MessageNode.model_construct(parent=None, token_ids=[i])
        return len(asked) - before

    monkeypatch.setattr(_fields, "takes_validated_data_argument", counted)
    per_node = nodes(1)
    assert per_node >= 1 and nodes(3) == 3 * per_node  # uncached: asked again for every node
    cache_factory_check()
    assert _fields.takes_validated_data_argument.__wrapped__ is counted
    assert nodes(1) == len(set(asked[:per_node])) < per_node  # once per distinct factory (`list` is several's)
    assert nodes(100) == 0  # every later node answered from the cache
    assert MessageNode.model_construct(parent=None).token_ids == []


def test_the_young_generation_threshold_is_raised_and_a_higher_one_kept():
    gc.set_threshold(700, 10, 10)
    tune_for_episodes()
    assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, 10, 10)
    gc.set_threshold(50_000, 5, 5)
    tune_for_episodes()
    assert gc.get_threshold() == (50_000, 5, 5)


def test_a_runtime_makes_its_work_dir_only_when_used(tmp_path, monkeypatch):
    """An episode that never uses its runtime's dir (the in-process chat harness) costs no mkdir/rmtree; one
    that runs a program there gets the same dir as before, removed at the end."""
    import asyncio

    from verifiers.v1 import runtimes
    from verifiers.v1.runtimes import subprocess as verifiers_subprocess

    original = verifiers_subprocess.SubprocessRuntime
    monkeypatch.setattr(verifiers_subprocess, "CACHE_DIR", tmp_path)
    tune_for_episodes()
    tune_for_episodes()
    assert runtimes.SubprocessRuntime.__mro__[2] is original  # wrapped once

    async def episode(use: bool) -> tuple:
        runtime = runtimes.make_runtime(runtimes.SubprocessConfig(), name=f"ep-{use}")
        await runtime.start()
        planned = tmp_path / "runtimes" / "subprocess" / f"ep-{use}"
        made_before = planned.exists()
        out = (await runtime.run(["pwd"], {})).stdout.strip() if use else None
        made_after = planned.is_dir()
        await runtime.teardown()
        return runtime, planned, made_before, out, made_after

    runtime, planned, made_before, _, made_after = asyncio.run(episode(False))
    assert isinstance(runtime, original) and runtime.info.id == str(planned)
    assert not made_before and not made_after and not planned.exists()
    runtime, planned, made_before, out, made_after = asyncio.run(episode(True))
    assert not made_before and out == str(planned) and made_after
    assert not planned.exists()  # removed by teardown, as verifiers' own runtime does
