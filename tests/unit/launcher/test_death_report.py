"""rl's death report: a child's logs are appended to across attempts, and only this attempt's lines are its error."""

from __future__ import annotations

import subprocess
import sys

from asyncrl.launcher.supervisor import Child
from asyncrl.transport.layout import RunLayout


def test_a_death_report_shows_this_attempts_lines_not_the_last_attempts(tmp_path):
    layout = RunLayout(tmp_path)
    log, stdout = layout.log_file("orchestrator"), layout.log_file("orchestrator", ".stdout")
    log.parent.mkdir(parents=True)
    log.write_text("10:00:00 ERROR   the previous attempt's error\n10:00:01 INFO    its last line\n")
    since = {p: p.stat().st_size if p.exists() else 0 for p in (log, stdout)}
    code = "import sys; sys.stdout.write('Traceback (most recent call last):\\nValueError: this attempt\\n')"
    with open(stdout, "ab") as sink:  # the child writes only to its stdout this time (e.g. it died importing)
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=sink)
    proc.wait()
    said = "\n".join(Child("orchestrator", proc, stdout, log, layout, since=since).logged())
    assert "ValueError: this attempt" in said and str(stdout) in said
    assert "previous attempt" not in said and str(log) not in said


def test_the_error_a_child_recorded_on_its_way_out_is_its_why(tmp_path):
    """A streamed trainer's `error:` line reaches only the console; its run record keeps it for the restart line."""
    import json
    import time

    layout = RunLayout(tmp_path)
    log = layout.log_file("trainer")
    log.parent.mkdir(parents=True)
    log.write_text("10:00:00 ERROR   an earlier attempt's error\n")
    since = {log: log.stat().st_size}
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    proc.wait()
    child = Child("trainer", proc, layout.log_file("trainer", ".stdout"), log, layout, since=since)
    assert child.error() is None  # nothing in this attempt
    with open(log, "a") as f:
        f.write("10:00:01 ERROR   [trainer] this attempt's log line\n")
    assert child.error() == "10:00:01 ERROR   [trainer] this attempt's log line"
    record = {"pid": proc.pid, "started": time.time(), "exit": 2, "error": "trainer rank 0 lost contact\nmore"}
    layout.pid_file("trainer").write_text(json.dumps(record))
    assert child.error() == "trainer rank 0 lost contact"
    layout.pid_file("trainer").write_text(json.dumps({**record, "started": child.started - 60}))  # an earlier one's
    assert child.error() == "10:00:01 ERROR   [trainer] this attempt's log line"
