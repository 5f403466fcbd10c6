"""This process, set up to run many verifiers v1 episodes at a small CPU cost each (`tune_for_episodes`).

An episode runs through verifiers' own v1 machinery (Env.run_episode, the interception server, the
training client); four costs of it sit in the libraries under that machinery, and are cut here by what
this process sets, not by a change to any library's code:

- the training client's engine calls go through `http.AioHttpTransport` (aiohttp's pool) instead of
  httpcore's, which probes every idle connection on each request it starts or ends (one connection per
  episode in flight: that scan cost more CPU than the rest of the model call);
- pydantic answers "does this default factory take the validated data?" by parsing the factory's
  signature on every `model_construct` (verifiers builds each trace's message nodes with it, and their
  factories are builtins such as `list`, whose signature is parsed from text): the answer is kept per
  factory;
- the GC's youngest generation holds 10,000 objects instead of 700: an episode's objects live across
  many collections of 700, so they were promoted and then freed by full collections, which scan every
  object of the process (the models, tokenizers and tasks loaded) each time;
- verifiers' subprocess runtime (every agent's, by default) makes a work dir per episode when it starts
  and removes it, through a worker thread, when the episode ends: ~0.4 ms of CPU per episode (of ~9 ms the
  orchestrator spends per reverse-text rollout), and a dir left in ~/.cache/verifiers by every episode of an
  orchestrator killed mid-step,
  for a dir the in-process chat harness never uses. Runtimes are made as `LazyWorkdirRuntime` instead:
  the same dir, at the path verifiers' own `start` gives it (its `info.id`), made the first time anything
  runs or reads or writes there, and removed at the end only if it was made.

Each patch here is an entry of the register, `asyncrl.core.patches` (with its tripwire).

Invariants: nothing an episode sends, receives or records changes (the same requests, the same token
ids and logprobs, the same traces); `tune_for_episodes` is idempotent; a GC threshold already above
ours (set by the user) is kept.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loguru import logger

from asyncrl.orchestrator.envs.http import AioHttpTransport

GC_YOUNG_THRESHOLD = 10_000  # objects allocated (net) between collections of the youngest generation


def tune_for_episodes() -> None:
    """Apply the four settings above to this process (a second call changes nothing)."""
    pool_train_client()
    cache_factory_check()
    lazy_runtime_workdirs()
    young, *older = gc.get_threshold()
    if young < GC_YOUNG_THRESHOLD:
        gc.set_threshold(GC_YOUNG_THRESHOLD, *older)
        logger.debug(f"GC: youngest generation collected every {GC_YOUNG_THRESHOLD} objects (was {young})")


def pool_train_client() -> None:
    """verifiers' TrainClient builds its OpenAI client with `build_async_openai` (a name of its module);
    wrap that so the client it gets sends over an `AioHttpTransport`, all else as verifiers built it."""
    from verifiers.v1.clients import train

    build = getattr(train, "build_async_openai", None)
    if build is None or getattr(build, "asyncrl_pooled", False):  # None: a verifiers that builds it elsewhere
        return

    def build_pooled(config: Any) -> Any:
        client = build(config)
        # the SDK's httpx client; its own transport is unused until the first request, so nothing to close
        client._client._transport = AioHttpTransport()
        return client

    build_pooled.asyncrl_pooled = True
    train.build_async_openai = build_pooled


def cache_factory_check() -> None:
    """pydantic's `takes_validated_data_argument` (a pure function of the factory), answered once per
    factory; an unhashable factory is checked every time, as before."""
    from pydantic._internal import _fields

    check = getattr(_fields, "takes_validated_data_argument", None)
    if check is None or getattr(check, "asyncrl_cached", False):  # None: a pydantic without that check
        return
    answers: dict[Callable, bool] = {}

    def cached(factory: Callable) -> bool:
        try:
            return answers[factory]
        except KeyError:
            answers[factory] = answer = check(factory)
            return answer
        except TypeError:  # unhashable
            return check(factory)

    cached.asyncrl_cached = True
    cached.__wrapped__ = check
    _fields.takes_validated_data_argument = cached


def lazy_runtime_workdirs() -> None:
    """verifiers makes every runtime through `make_runtime`, which picks the subprocess runtime's class by its
    name in `verifiers.v1.runtimes`: that name is pointed at `LazyWorkdirRuntime` (a subclass: isinstance
    holds)."""
    from verifiers.v1 import runtimes

    if getattr(runtimes, "SubprocessRuntime", None) is None or issubclass(runtimes.SubprocessRuntime, LazyWorkdir):
        return
    runtimes.SubprocessRuntime = type("LazyWorkdirRuntime", (LazyWorkdir, runtimes.SubprocessRuntime), {})


class LazyWorkdir:
    """Mixed in before verifiers' SubprocessRuntime: verifiers' own `start` plans `workdir` (its path and
    `info.id`), its mkdir deferred; the dir is made on first access; `teardown`/`cleanup` remove it only if it
    was made."""

    _planned: Path | None = None
    _made = False
    _starting = False

    @property
    def workdir(self) -> Path | _Unmade | None:
        if self._starting:
            return _Unmade(self._planned)
        if self._planned is not None and not self._made:
            self._planned.mkdir(parents=True, exist_ok=True)
            self._made = True
        return self._planned

    @workdir.setter
    def workdir(self, path: Path | None) -> None:
        self._planned, self._made = path, False

    async def start(self) -> None:
        self._starting = True
        try:
            await super().start()
        finally:
            self._starting = False

    async def teardown(self) -> None:
        self._forget_unmade()
        await super().teardown()

    def cleanup(self) -> None:
        self._forget_unmade()
        super().cleanup()

    def _forget_unmade(self) -> None:
        if not self._made:
            self._planned = None  # nothing was ever put there: nothing to remove


class _Unmade:
    """The planned work dir as verifiers' `start` sees it: its path (`str`), its `mkdir` left to first use."""

    def __init__(self, path: Path | None) -> None:
        self.path = path

    def mkdir(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __str__(self) -> str:
        return str(self.path)
