"""Shared fixtures: one tiny model per test session (built locally, no download); loguru capture; inference
servers shared for the session by the suites that need the same server."""

from __future__ import annotations

import functools
import gc
import json
import os
import resource
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "integration"))  # server_proc
from server_proc import BACKENDS, ServerProcess, start_server  # noqa: E402

# The collector is off while the suite imports and collects (the objects made then live to the end: collecting them
# cost a worker ~2 CPU s); they are frozen before the first test runs (`pytest_runtestloop`), so the full
# collections the tests set off never walk them (each took ~0.2 s a worker).
gc.disable()

# The tests press Ctrl-C (SIGINT) on the processes they start as a user at a terminal would. Run in the
# background of a non-interactive shell (`bash .ci/run &`), every process inherits SIGINT ignored, and so would
# each rl a test starts: handle it here, so children start with the default (Python's KeyboardInterrupt).
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _no_inherited_run_lock():
    """An entrypoint's main() run in this process joins its run dir (`utils.runlock`) and exports
    ASYNCRL_INHERITED_FD for the processes it starts: not for the processes later tests start, which would
    take themselves for an rl's children."""
    before = os.environ.get("ASYNCRL_INHERITED_FD")
    yield
    if before is None:
        os.environ.pop("ASYNCRL_INHERITED_FD", None)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from asyncrl.utils.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"), hidden_size=64, num_layers=2)


@pytest.fixture
def caplog_loguru():
    """The messages loguru logs during the test (pytest's caplog does not see loguru)."""
    from loguru import logger

    messages: list[str] = []
    sink = logger.add(lambda m: messages.append(m.record["message"]), level="DEBUG")
    yield messages
    logger.remove(sink)


# ---- servers shared by several suites ------------------------------------------------------------------------
# `shared_server`: the inference contract, the hostile-input suite and the vLLM backend's suite all talk to it: one
# per backend, serving `served_model_dir` with the contract's options (server_proc.start_server: api key, hermes
# tools, qwen3 reasoning, max_model_len 512, LoRA on) and `--allowed-weights-root` = this session's pytest
# temp dir (every weight/adapter dir a test writes is in it; no generated hostile path is).
# `shared_inference_process`: the `inference` entrypoint serving `tiny_model_dir` (server_proc.ServerProcess),
# for the eval and synthesize suites.
# A test that changes what a shared server serves (weights, adapters) puts the base weights back; the suites
# check that it did. The tests of each shared server run as one block (pytest_collection_modifyitems below)
# and the server stops right after the last of them: one start each, and none left running (holding memory)
# through the rest of the session.

SHARED_FIXTURES = ("shared_server", "shared_inference_process")
_RUNNING: dict[tuple, Callable[[], None]] = {}  # shared key -> how to stop its server, while it runs
_LAST_USER: dict[tuple, str] = {}  # shared key -> node id of the last test that uses that server


@pytest.fixture(scope="session")
def served_model_dir(tmp_path_factory) -> Path:
    from asyncrl.utils.tiny_model import build_tiny_model

    # head_dim 32 (hidden 128 / 4 heads) so vLLM's CPU attention can serve the same model.
    return build_tiny_model(tmp_path_factory.mktemp("served_model"), hidden_size=128, num_layers=2, num_heads=4)


@pytest.fixture(scope="session")
def served_weights_root(tmp_path_factory) -> Path:
    """The shared servers' `--allowed-weights-root`: this session's pytest temp dir."""
    return tmp_path_factory.getbasetemp().resolve()


@pytest.fixture(scope="session", params=BACKENDS)
def shared_server(request, served_model_dir, served_weights_root):
    key = ("shared_server", request.param)
    srv = start_server(request.param, served_model_dir, allowed_weights_root=served_weights_root)
    _RUNNING[key] = srv.stop
    yield srv
    _stop_shared(key)


@pytest.fixture(scope="session")
def shared_inference_process(tiny_model_dir, tmp_path_factory):
    key = ("shared_inference_process", None)
    proc = ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("inference_server"))
    _RUNNING[key] = proc.stop
    yield proc
    _stop_shared(key)


def _stop_shared(key: tuple) -> None:
    stop = _RUNNING.pop(key, None)
    if stop is not None:
        stop()


def _shared_key(item) -> tuple | None:
    """Which shared server `item` uses, with its parameter (the backend), if any."""
    for name in SHARED_FIXTURES:
        if name in getattr(item, "fixturenames", ()):
            callspec = getattr(item, "callspec", None)
            return name, callspec.params.get(name) if callspec is not None else None
    return None


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """The tests of each shared server (and backend) as one block, in collection order, where the first of them
    was; the other tests keep their order. Under pytest-xdist (scripts/test.sh: -n 4 --dist loadgroup on two
    cores) each block is one group, so one worker starts that server once, and the slow tests go first: the
    workers then end together, the quick tests filling the gaps."""
    _quarantine(items)
    _shared_blocks(items)
    if hasattr(config, "workerinput"):  # a pytest-xdist worker (only workers collect)
        _xdist_groups(items)
    from tests import warm

    warm.use_for(items)  # the zygote of the processes the tests start: for sessions with slow tests


# ---- quarantine ----------------------------------------------------------------------------------------------
# A test known to be flaky, until it is fixed where it is flaky: its node id (or a prefix: a file, a test without
# its [param]) -> why, and the issue that fixes it. It still runs, as a non-strict xfail: its result is reported
# (XPASS / XFAIL) but does not fail the run. Never a looser bound instead.
QUARANTINE: dict[str, str] = {}


def _quarantine(items) -> None:
    for item in items:
        for prefix, why in QUARANTINE.items():
            if item.nodeid.startswith(prefix):
                item.add_marker(pytest.mark.xfail(reason=f"quarantined: {why}", strict=False))


# ---- pytest-xdist: the groups ------------------------------------------------------------------------------
# xdist's own `--dist loadgroup` names a test's group by appending it to the test's id, which pytest 9 no
# longer lets a plugin change; so the workers write {test id: group} to a dir the controller made (its path
# in GROUPS_VAR, inherited by the workers) and the controller schedules whole groups with xdist's scope
# scheduler, its scope being the group. A test outside every group is a scope of its own.
GROUPS_VAR = "ASYNCRL_XDIST_GROUPS"
_GROUPS: dict[str, str] = {}  # worker: test id -> group, for what it collected


def _xdist_groups(items) -> None:
    """Every vLLM test in one group (one vLLM server at a time: each sizes its KV cache from free RAM), each
    other shared server's tests in one group, and the tests of a module that share a module- or class-scoped
    fixture in one group (one worker builds it once; split across workers, each would build it). Then the
    groups (a test outside every group: its own) longest first by `cost`, each kept whole and in its order:
    the workers then end together, the quick tests filling the gaps at the end."""
    for item in items:
        if (group := _group_of(item)) is not None:
            _GROUPS[item.nodeid] = group
    costs: dict[str, float] = {}
    for item in items:
        scope = _GROUPS.get(item.nodeid, item.nodeid)
        costs[scope] = costs.get(scope, 0.0) + cost(item)
    index = {item.nodeid: i for i, item in enumerate(items)}
    first = {}
    for item in items:
        first.setdefault(_GROUPS.get(item.nodeid, item.nodeid), index[item.nodeid])
    items.sort(
        key=lambda item: (
            -costs[scope := _GROUPS.get(item.nodeid, item.nodeid)],
            first[scope],
            "slow" not in item.keywords,
            index[item.nodeid],
        )
    )


def _group_of(item) -> str | None:
    if "vllm" in item.keywords:
        return "vllm"
    if (key := _shared_key(item)) is not None:
        return f"{key[0]}-{key[1]}"
    fixturedefs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    if any(getattr(d, "scope", None) in ("class", "module", "package") for defs in fixturedefs.values() for d in defs):
        return f"module-{item.nodeid.split('::')[0]}"
    return None


# Seconds a test took in CI (call + setup, 2 workers busy), for the order above; rough is fine, only the order
# matters. A test not named here: SLOW_S if marked slow (IN_GROUP_S in a group: its server or fixture is built
# once for all of them), else QUICK_S. A name without its [param] covers each; a file, each test in it.
KNOWN_S = {
    "tests/integration/test_multi_run_rl.py::test_two_runs_learn_side_by_side_and_one_resumes_alone": 60,
    "tests/integration/test_rl.py::test_rl_runs_learns_and_resumes": 101,
    "tests/integration/test_multi_node_rl.py::test_three_hosts_train_and_weights_reach_the_server": 40,
    "tests/integration/test_classic_envs.py::test_rl_trains_a_classic_environment": 40,
    "tests/reliability/test_hostile.py::test_generated_requests": 79,
    "tests/integration/test_lora_adapters.py::test_rl_serves_each_policy_as_the_runs_adapter": 62,
    "tests/integration/test_bench.py::test_rl_bench_writes_every_number": 62,
    "tests/integration/test_bench.py::test_warmup_builds_trains_chooses_and_is_reused": 50,
    "tests/reliability/test_chaos.py::test_kill_then_resume_loses_and_repeats_no_step": 24,  # x8, one group
    "tests/integration/test_vllm_multi_node.py::test_the_headless_node_serves_and_takes_weight_updates": 50,
    "tests/reliability/test_full_disk.py": 40,
    "tests/integration/test_multi_run_rl.py::test_killing_one_runs_orchestrator_leaves_the_other_training": 37,
    "tests/reliability/test_orphans.py": 31,
    "tests/integration/test_multi_node_rl.py::test_a_trainer_node_that_dies_stops_the_other_with_a_clear_error": 30,
    "tests/integration/test_rl.py::test_a_hung_trainer_is_named_and_the_run_stopped": 30,
    "tests/integration/test_prime_rl_twins.py::test_inference_orchestrator_and_eval_debug_twins": 28,
}
SLOW_S, IN_GROUP_S, QUICK_S = 10.0, 3.0, 0.5


def cost(item) -> float:
    """What `item` is expected to take, in seconds: KNOWN_S, by test (any parameter) or by file."""
    for known in (item.nodeid.split("[")[0], item.nodeid.split("::")[0]):
        if known in KNOWN_S:
            return KNOWN_S[known]
    if "slow" not in item.keywords:
        return QUICK_S
    return IN_GROUP_S if item.nodeid in _GROUPS else SLOW_S


def pytest_configure(config):
    if config.pluginmanager.hasplugin("xdist") and not hasattr(config, "workerinput"):
        import tempfile

        os.environ[GROUPS_VAR] = tempfile.mkdtemp(prefix="asyncrl-xdist-groups-")


def pytest_unconfigure(config):
    if not hasattr(config, "workerinput") and GROUPS_VAR in os.environ:
        import shutil

        shutil.rmtree(os.environ.pop(GROUPS_VAR), ignore_errors=True)


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session):
    gc.freeze()
    gc.enable()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        """xdist's scope scheduler, the scope of a test being its group (read once all workers collected)."""

        def _split_scope(self, nodeid: str) -> str:
            return _written_groups().get(nodeid, nodeid)

    return ByGroup(config, log)


@functools.cache
def _written_groups() -> dict[str, str]:
    groups: dict[str, str] = {}
    for path in Path(os.environ[GROUPS_VAR]).glob("*.json"):
        groups.update(json.loads(path.read_text()))
    return groups


def _shared_blocks(items) -> None:
    keys = {item: _shared_key(item) for item in items}
    ordered, placed = [], set()
    for item in items:
        key = keys[item]
        if key is None:
            ordered.append(item)
        elif key not in placed:
            placed.add(key)
            ordered += [i for i in items if keys[i] == key]
    items[:] = ordered


@pytest.hookimpl(tryfirst=True)  # before xdist tells the controller it collected: the groups are written by then
def pytest_collection_finish(session):
    if hasattr(session.config, "workerinput") and GROUPS_VAR in os.environ:
        worker = session.config.workerinput["workerid"]
        tmp = Path(os.environ[GROUPS_VAR]) / f".{worker}.tmp"
        tmp.write_text(json.dumps(_GROUPS))
        tmp.rename(tmp.with_name(f"{worker}.json"))
    _LAST_USER.clear()
    for item in session.items:  # after any deselection
        key = _shared_key(item)
        if key is not None:
            _LAST_USER[key] = item.nodeid


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    key = _shared_key(item)
    if key is not None and _LAST_USER.get(key) == item.nodeid:
        _stop_shared(key)


# ---- what each test costs in CPU -----------------------------------------------------------------------------
# ASYNCRL_TEST_CPU_LOG=PATH: each worker appends one JSON line per test to PATH.<pid>: its id, wall seconds and
# CPU seconds (this process and every child it reaped: an `rl` a test ran, with that rl's own children; a shared
# server, in the test after which it stops; a process tests/warm.py's zygote forked for it, the same). CPU, unlike
# wall time, does not grow with the machine's load, so the sum says what the suite needs of the machine.
# `python scripts/test_cpu.py PATH` prints the table.
CPU_LOG_VAR = "ASYNCRL_TEST_CPU_LOG"


def _cpu_s() -> float:
    from tests.warm import forked_cpu_s

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + forked_cpu_s()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    log = os.environ.get(CPU_LOG_VAR)
    cpu, wall, start = _cpu_s(), time.monotonic(), time.time()
    yield
    if log:
        row = {"test": item.nodeid, "start": start, "wall_s": time.monotonic() - wall, "cpu_s": _cpu_s() - cpu}
        Path(log).parent.mkdir(parents=True, exist_ok=True)  # e.g. /tmp/cpu/log: its dir need not exist yet
        with open(f"{log}.{os.getpid()}", "a") as f:
            f.write(json.dumps(row) + "\n")
