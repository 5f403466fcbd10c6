"""Warm starts (`launcher.zygote`): a forked child is the process an exec would have made, and rl hears its end."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest

from asyncrl.launcher import zygote
from asyncrl.utils.process import PIPED, running
from tests.integration.waiting import wait_until

PROBE = Path(__file__).parent / "probe"


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """One zygote for the module (it preloads torch, transformers and verifiers: seconds of CPU)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", os.pathsep.join([str(PROBE), os.environ.get("PYTHONPATH", "")]))
        z = zygote.Zygote("zygote-test", tmp_path_factory.mktemp("zygote") / "zygote.log")
    yield z
    z.close()


def probe(*args: str) -> list[str]:
    return [sys.executable, "-m", "zygote_probe", *args]


def test_a_forked_child_is_what_an_exec_would_make(warm, tmp_path):
    log = tmp_path / "child.log"
    env = {**os.environ, "PROBE": "seen", "OMP_NUM_THREADS": "1"}
    child = warm.spawn(probe("report", "3"), log, env, cores=[0])  # pinned before it runs a line
    assert isinstance(child, zygote.Forked) and child.wait(120) == 3 and child.poll() == 3
    said = json.loads(log.read_text().splitlines()[-1])
    assert said["argv"] == ["report", "3"] and said["probe"] == "seen" and said["main"] == "__main__"
    assert said["session_leader"] and said["stdin"] == os.devnull and said["threads"] == 1 and said["cores"] == [0]
    assert said["cmdline"] == " ".join(probe("report", "3"))


def test_a_piped_child_streams_and_a_signal_is_its_negative_code(warm):
    child = warm.spawn(probe("sleep"), PIPED, dict(os.environ))
    assert child.stdout.readline() == b"sleeping\n"
    os.kill(child.pid, signal.SIGKILL)
    assert child.wait(60) == -signal.SIGKILL


def test_fork_gives_separate_streams_a_cwd_and_the_cpu_it_used(warm, tmp_path):
    (out_r, out_w), (err_r, err_w) = os.pipe(), os.pipe()
    child = warm.fork(probe("streams"), dict(os.environ), (out_w, err_w), cwd=str(tmp_path))  # closes the ends
    with open(out_r) as out, open(err_r) as err:
        assert out.read() == f"out {tmp_path}\n" and err.read() == "err\n"
    assert child.wait(60) == 0 and child.cpu_s >= 0.4  # as wait4 counted it in the zygote
    assert warm.reaped_cpu_s >= child.cpu_s


def test_a_forked_process_forks_its_own_zygote_and_others_exec_theirs(warm, tmp_path):
    log = tmp_path / "nest.log"
    assert warm.spawn(probe("nest", str(tmp_path / "nested.log")), log, dict(os.environ)).wait(120) == 0
    assert json.loads(log.read_text().splitlines()[-1]) == {"forked_zygote": True, "code": 3}
    assert not zygote._warm() and not isinstance(warm.proc, zygote.Forked)  # this test process: it execs


def test_only_this_pythons_modules_are_forked(warm, tmp_path):
    assert warm.spawn(["/bin/true"], tmp_path / "log", dict(os.environ)) is None
    assert warm.spawn(["python3", "-m", "json.tool"], tmp_path / "log", dict(os.environ)) is None


def test_no_zygote_where_forking_is_off_or_unsafe(monkeypatch, tmp_path):
    assert zygote.start_zygote("m", tmp_path / "log", cuda=True) is None
    monkeypatch.setenv(zygote.VAR, "0")
    assert zygote.start_zygote("m", tmp_path / "log", cuda=False) is None


def test_the_zygotes_death_ends_its_children_and_their_ends_are_seen(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(PROBE))
    z = zygote.Zygote("zygote-test", tmp_path / "zygote.log")
    child = z.spawn(probe("sleep"), tmp_path / "child.log", dict(os.environ))
    log = tmp_path / "child.log"
    assert wait_until(lambda: log.exists() and "sleeping" in log.read_text(), 120)
    os.kill(z.proc.pid, signal.SIGKILL)
    assert child.wait(60) is not None and not running(child.pid)
    assert z.spawn(probe("report", "0"), tmp_path / "child.log", dict(os.environ)) is None  # rl execs from now on
    z.proc.wait()
