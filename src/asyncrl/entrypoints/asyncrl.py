"""`asyncrl status RUN_DIR` and `asyncrl report RUN_DIR [RUN_DIR ...] [--out FILE]`: look at runs without W&B."""

from __future__ import annotations

import sys
from pathlib import Path

from asyncrl.config.cli import fail
from asyncrl.core.errors import UserError

STATUS = (
    "asyncrl status RUN_DIR",
    """  status RUN_DIR   where a running or finished run is: each process alive / finished / failed, its last
                   step, reward or loss and throughput, the restarts rl made, the off-policy lag and the
                   last errors""",
)
REPORT = (
    "asyncrl report RUN_DIR [RUN_DIR ...] [--out FILE]",
    """  report RUN_DIR   RUN_DIR/report.html: every curve of the run (PNGs in RUN_DIR/report/), its status and
                   config, in one file that opens offline; several runs: their curves overlaid, in
                   ./report.html (or --out FILE)""",
)
USAGE = f"usage: {STATUS[0]}\n       {REPORT[0]}\n\n{STATUS[1]}\n{REPORT[1]}"
HELP = {name: f"usage: {line}\n\n{said}" for name, (line, said) in {"status": STATUS, "report": REPORT}.items()}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if argv else sys.stderr)
        raise SystemExit(0 if argv else 2)
    command, *rest = argv
    if command in HELP and any(a in ("-h", "--help") for a in rest):
        print(HELP[command])
        raise SystemExit(0)
    try:
        if command == "status":
            status(rest)
        elif command == "report":
            report(rest)
        else:
            fail(f"unknown command {command!r}; commands: status, report (see asyncrl --help)")
    except UserError as e:
        fail(str(e))


def status(rest: list[str]) -> None:
    from asyncrl.report.status import status_lines

    if len(rest) != 1:
        fail("asyncrl status takes one run directory, e.g. asyncrl status outputs/demo/rl")
    print("\n".join(status_lines(Path(rest[0]))))


def report(rest: list[str]) -> None:
    from asyncrl.report.report import check_runs, write_report

    out = None
    if "--out" in rest:
        at = rest.index("--out")
        if at + 1 >= len(rest):
            fail("--out needs a file path, e.g. --out ablation.html")
        out, rest = Path(rest[at + 1]), rest[:at] + rest[at + 2 :]
    if unknown := [a for a in rest if a.startswith("-")]:
        fail(f"unknown option {unknown[0]} (asyncrl report RUN_DIR [RUN_DIR ...] [--out FILE])")
    path = write_report(check_runs(rest), out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
