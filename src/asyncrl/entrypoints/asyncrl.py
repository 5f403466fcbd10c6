"""`asyncrl status RUN_DIR`: look at a run without W&B."""

from __future__ import annotations

import sys
from pathlib import Path

from asyncrl.config.cli import fail

USAGE = """usage: asyncrl status RUN_DIR

  status RUN_DIR   where a running or finished run is: each process alive / finished / failed, its last
                   step, reward or loss and throughput, the off-policy lag and the last errors"""


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if argv else sys.stderr)
        raise SystemExit(0 if argv else 2)
    command, *rest = argv
    if command != "status":
        fail(f"unknown command {command!r}; commands: status (see asyncrl --help)")
    if len(rest) != 1:
        fail("asyncrl status takes one run directory, e.g. asyncrl status outputs/demo/rl")
    from asyncrl.report.status import status_lines
    from asyncrl.utils.errors import UserError

    try:
        print("\n".join(status_lines(Path(rest[0]))))
    except UserError as e:
        fail(str(e))


if __name__ == "__main__":
    main()
