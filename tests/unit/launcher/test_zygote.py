"""Warm starts (`launcher.zygote`): a forked child is the process an exec would have made, and rl hears its end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.launcher import zygote
from asyncrl.utils.process import PIPED, running
from tests.integration.waiting import wait_until

PROBE = Path(__file__).parent / "probe"


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """One zygote for the module (it preloads torch, transformers and verifiers: seconds of CPU); the probe's
    directory on PYTHONPATH for it and for the children the tests give this environment."""
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
    assert said["gc"] and said["frozen"] > 100_000  # collecting, and never walking what the zygote imported


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


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
RANK = ["-m", "asyncrl.launcher.warm_ranks"]  # each rank prints what kind of process it is


def ranks_said(log: Path) -> list[dict]:
    said = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    return sorted(said, key=lambda r: r["rank"])


def test_a_forked_torchrun_forks_its_ranks_as_torchrun_would_exec_them(warm, tmp_path):
    forked, execd = tmp_path / "forked.log", tmp_path / "exec.log"
    assert warm.spawn([*TORCHRUN, *RANK], forked, dict(os.environ)).wait(120) == 0
    with open(execd, "w") as out:  # the same command from a shell: torchrun execs its ranks
        assert subprocess.run([*TORCHRUN, *RANK], stdout=out, stderr=subprocess.STDOUT, timeout=120).returncode == 0
    warm_ranks, cold_ranks = ranks_said(forked), ranks_said(execd)
    assert [r["rank"] for r in warm_ranks] == [r["rank"] for r in cold_ranks] == [0, 1]
    assert all(r["forked"] and "asyncrl.launcher.zygote torchrun-" in r["parent"] for r in warm_ranks)
    assert not any(r["forked"] for r in cold_ranks)
    same = ("rank", "cmdline", "session_leader", "stdout", "lock")
    assert [{k: r[k] for k in same} for r in warm_ranks] == [{k: r[k] for k in same} for r in cold_ranks]
    assert warm_ranks[0]["cmdline"] == f"{sys.executable} -u -m asyncrl.launcher.warm_ranks"
    assert warm_ranks[0]["stdout"] == ["TextIOWrapper", "FileIO"]  # -u: no buffer under the text layer


def test_a_forked_rank_that_fails_fails_torchrun_and_its_peer_is_stopped(warm, tmp_path):
    log = tmp_path / "torchrun.log"
    agent = warm.spawn([*TORCHRUN, *RANK, "fail"], log, dict(os.environ))
    assert agent.wait(120) == 1
    said = log.read_text()
    assert "exitcode  : 3" in said and "asyncrl.launcher.warm_ranks FAILED" in said, said[-3000:]
    peer = next(r for r in ranks_said(log) if r["rank"] == 0)
    assert peer["forked"] and not running(peer["pid"])  # torchrun stopped it (SIGTERM to its session)


def test_a_forked_child_finds_modules_where_an_exec_would(warm, tmp_path):
    """Its cwd and PYTHONPATH come first on sys.path, as `python -m` puts them, not the zygote's."""
    extra = tmp_path / "extra"
    extra.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(extra), str(PROBE)])}
    log = tmp_path / "child.log"
    execd = subprocess.run(probe("report", "0"), env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    out = os.open(log, os.O_WRONLY | os.O_CREAT, 0o644)
    forked = warm.fork(probe("report", "0"), env, (out,), cwd=str(tmp_path))  # the zygote started elsewhere
    assert forked.wait(120) == 0
    said, expected = json.loads(log.read_text().splitlines()[-1]), json.loads(execd.stdout.splitlines()[-1])
    assert said["path"] == expected["path"] == [str(tmp_path), str(extra), str(PROBE)]
