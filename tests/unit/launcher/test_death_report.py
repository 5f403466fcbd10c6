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
