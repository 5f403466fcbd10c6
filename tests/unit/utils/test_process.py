"""Child processes: spawn with a log, wait for HTTP (up, died, timed out), stop a whole process group."""

import os
import signal
import subprocess
import sys
import time

import pytest
from waiting import wait_until

from asyncrl.utils.process import (
    ChildExited,
    free_port,
    process_tree,
    processes_by_role,
    serve,
    spawn,
    stop_group,
    stop_groups,
    tail,
    wait_for_http,
)


def test_wait_for_a_server_that_comes_up(tmp_path):
    port = free_port()
    cmd = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
    proc = serve(cmd, f"http://127.0.0.1:{port}/", tmp_path / "srv.log", timeout=30, poll=0.05)
    assert proc.poll() is None
    stop_group(proc)
    assert proc.returncode is not None


def test_serve_stops_a_server_that_never_answers(tmp_path):
    cmd = [sys.executable, "-c", "import time; print('starting', flush=True); time.sleep(60)"]
    with pytest.raises(TimeoutError, match=r"(?s)did not answer 200 within 2s.*starting"):
        serve(cmd, f"http://127.0.0.1:{free_port()}/health", tmp_path / "s.log", timeout=2, poll=0.05)


def test_a_dead_child_fails_early_with_its_log(tmp_path):
    log = tmp_path / "logs" / "child.log"
    proc = spawn([sys.executable, "-c", "import sys; print('boom here'); sys.exit(3)"], log)
    start = time.monotonic()
    with pytest.raises(ChildExited, match=r"(?s)exited with code 3.*boom here") as err:
        wait_for_http(f"http://127.0.0.1:{free_port()}/health", timeout=60, proc=proc, log=log, poll=0.05)
    assert err.value.returncode == 3 and time.monotonic() - start < 30


def test_timeout_names_the_url():
    url = f"http://127.0.0.1:{free_port()}/health"
    with pytest.raises(TimeoutError, match=url):
        wait_for_http(url, timeout=0.2, poll=0.05)


def test_stop_reaches_grandchildren_and_kills_what_ignores_sigterm(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
    parent = (
        f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', {stubborn!r}]); "
        f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)"
    )
    proc = spawn([sys.executable, "-c", parent], tmp_path / "p.log")
    assert wait_until(lambda: pid_file.exists() and pid_file.read_text(), 60)
    grandchild = int(pid_file.read_text())
    assert stop_groups([proc], grace=0.5) == []  # the parent obeys SIGTERM; its child is killed with the group
    assert wait_until(lambda: not _alive(grandchild), 10)


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace(tmp_path):
    ready = tmp_path / "ready"
    ignore = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN)"
    code = f"{ignore}; open({str(ready)!r}, 'w'); time.sleep(60)"
    proc = spawn([sys.executable, "-c", code], None)
    assert wait_until(ready.exists, 60)
    assert stop_groups([proc], grace=0.3) == [proc] and proc.returncode == -9


def test_tail(tmp_path):
    log = tmp_path / "x.log"
    log.write_text("".join(f"line {i}\n" for i in range(30)))
    assert tail(log, 2, prefix="  ") == "  line 28\n  line 29"
    assert "no log" in tail(tmp_path / "missing.log")


def _alive(pid: int) -> bool:
    """Running (a zombie awaiting its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_a_death_report_shows_the_errors_a_long_log_buried(tmp_path):
    from asyncrl.utils.process import telling_tail

    log = tmp_path / "x.log"
    lines = ["10:00:00 INFO    start", "10:00:01 WARNING low memory", "10:00:02 ERROR   CUDA out of memory"]
    log.write_text("\n".join(lines + [f"progress {i}%" for i in range(40)]) + "\n")
    shown = telling_tail(log, lines=3).splitlines()
    assert shown == ["10:00:01 WARNING low memory", "10:00:02 ERROR   CUDA out of memory", "...",
                     "progress 37%", "progress 38%", "progress 39%"]  # fmt: skip
    log.write_text("a\nb\n")
    assert telling_tail(log, lines=3) == "a\nb"


def test_a_spawned_child_dies_with_its_parent_whatever_kills_it(tmp_path):
    """PR_SET_PDEATHSIG: SIGKILL of the parent, and the child (in a session of its own) gets SIGTERM."""
    pid_file = tmp_path / "child.pid"
    parent = (
        "import sys, time; from asyncrl.utils.process import spawn; "
        f"p = spawn([sys.executable, '-c', 'import time; time.sleep(60)'], None); "
        f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)"
    )
    proc = spawn([sys.executable, "-c", parent], tmp_path / "p.log")
    assert wait_until(lambda: pid_file.exists() and pid_file.read_text(), 60)
    proc.kill()
    proc.wait()
    child = int(pid_file.read_text())
    assert wait_until(lambda: not _alive(child), 5)


def test_the_run_lock_is_held_by_the_children_and_freed_when_the_last_one_ends(tmp_path):
    from asyncrl.core.errors import UserError
    from asyncrl.utils import runlock

    run, pid_file = tmp_path / "run", tmp_path / "child.pid"
    stubborn = (  # ready (its pid written) once it ignores SIGTERM
        "import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        f"open({str(pid_file)!r} + '.tmp', 'w').write(str(os.getpid())); os.rename({str(pid_file)!r} + '.tmp', "
        f"{str(pid_file)!r}); time.sleep(60)"
    )
    holder = (  # takes the lock, hands it to a child that outlives it (it ignores its SIGTERM), ends
        "import os, sys, time; from asyncrl.utils import runlock; from asyncrl.utils.process import spawn; "
        f"runlock.hold({str(run)!r}); spawn([sys.executable, '-c', {stubborn!r}], None)\n"
        f"while not os.path.exists({str(pid_file)!r}): time.sleep(0.02)"
    )
    subprocess.run([sys.executable, "-c", holder], check=True, timeout=60)
    child = int(pid_file.read_text())
    with pytest.raises(UserError, match=rf"in use: rl \(pid \d+\) is gone, but .* \(pids {child}\)"):
        runlock.hold(run)
    os.kill(child, signal.SIGKILL)
    assert wait_until(lambda: not _alive(child), 5)
    fd = runlock.hold(run)  # the kernel dropped it with its last holder
    os.close(fd)
    os.environ.pop("ASYNCRL_INHERITED_FD")


def test_a_death_report_shows_only_what_this_attempt_wrote(tmp_path):
    from asyncrl.utils.process import telling_tail

    log = tmp_path / "x.log"
    log.write_text("old ERROR from an earlier attempt\nold last line\n")
    start = log.stat().st_size
    with open(log, "a") as f:
        f.write("new line\n")
    assert telling_tail(log, start=start) == "new line"
    assert "old last line" in telling_tail(log, start=10**6)  # shorter than that: a new file, all of it


def test_free_ports_lie_below_the_ephemeral_range_and_are_free():
    """An outgoing connection is never handed such a port while its server starts (chaos CI: a resumed rl's
    server lost its port to one, 'address already in use')."""
    import socket

    from asyncrl.utils.process import PORTS_FROM, _ephemeral_low

    ports = {free_port() for _ in range(20)}
    assert all(PORTS_FROM <= p < _ephemeral_low() for p in ports) and len(ports) > 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))


def test_processes_by_role_leaves_out_a_fork_of_a_process_of_its_role(tmp_path):
    """A forked child shows its parent's command line until it execs: it is not a second process of the role."""
    marker = str(tmp_path / "run")
    code = "import os, sys, time; os.fork(); sys.stdout.write('up\\n'); sys.stdout.flush(); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code, marker, "asyncrl.entrypoints.trainer"], stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline() and proc.stdout.readline()  # both the parent and its fork are running
        found = processes_by_role(marker, {"trainer": "asyncrl.entrypoints.trainer", "inference": "inference"})
        assert list(found.values()) == [("trainer", os.getpid())], found
        assert processes_by_role(str(tmp_path / "other"), {"trainer": "asyncrl.entrypoints.trainer"}) == {}
    finally:
        for pid, _ in process_tree(proc.pid):
            os.kill(pid, signal.SIGKILL)
        proc.wait()
