"""`asyncrl status RUN_DIR` and `asyncrl report RUN_DIR [RUN_DIR ...] [options]`: look at runs without W&B.

Bad arguments: one line naming what was wrong and how to fix it, exit 2, nothing written."""

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
    "asyncrl report RUN_DIR [RUN_DIR ...] [--out FILE] [--label L ...] [--metric KEY] [--threshold X]\n"
    "                      [--smoothing W] [--png]",
    """  report RUN_DIR   RUN_DIR/report.html: every curve of the run, its status, samples and config, in one
                   file that opens offline (zoom, hover, smoothing, step or wall-time axis; PNGs in
                   RUN_DIR/report/*.png); several runs: one colour per run in every plot, labelled by what
                   differs between their configs, and a time-to-accuracy table (also printed), in
                   ./report.html (or --out FILE)
    --out FILE       where the page goes
    --label L        a run's label instead of its config differences; once per run, in the runs' order
    --metric KEY     the time-to-accuracy metric, a metrics.jsonl key (default: eval/reward/mean when
                     every run evaluated 3+ times, else the EMA-smoothed reward/mean); higher is better
    --threshold X    the value to reach (default: the worst run's final value); one run has the table
                     only when --metric or --threshold is given
    --smoothing W    the EMA weight the page opens with and the PNGs and table use: 0 (none) to 0.99,
                     default 0.8
    --png            a comparison's PNGs too (one run: always), beside FILE in FILE without .html""",
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


VALUED = ("--out", "--label", "--metric", "--threshold", "--smoothing")


def report_options(rest: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    """The run dirs and each option's values (every option takes one value; only --label repeats)."""
    runs, given = [], {}
    it = iter(rest)
    for arg in it:
        name, eq, value = arg.partition("=")
        if name not in VALUED:
            if arg.startswith("-"):
                fail(f"unknown option {arg} (see asyncrl report --help)")
            runs.append(arg)
            continue
        value = value if eq else next(it, None)
        if value is None:
            fail(f"{name} needs a value (see asyncrl report --help)")
        given.setdefault(name, []).append(value)
    if twice := [n for n, v in given.items() if len(v) > 1 and n != "--label"]:
        fail(f"{twice[0]} given twice; give it once")
    return runs, given


def number(given: dict[str, list[str]], name: str, low: float, high: float) -> float | None:
    if name not in given:
        return None
    try:
        value = float(given[name][0])
    except ValueError:
        value = float("nan")
    if not low <= value <= high:
        fail(f"{name} {given[name][0]!r} is not a number from {low:g} to {high:g}")
    return value


def report(rest: list[str]) -> None:
    from asyncrl.report.curves import SMOOTHING
    from asyncrl.report.report import Options, check_runs, write
    from asyncrl.report.tta import text

    pngs = "--png" in rest
    paths, given = report_options([a for a in rest if a != "--png"])
    runs = check_runs(paths)
    smoothing = number(given, "--smoothing", 0.0, 0.99)
    options = Options(
        labels=given.get("--label"),
        metric=given.get("--metric", [None])[0],
        threshold=number(given, "--threshold", -float("inf"), float("inf")),
        smoothing=SMOOTHING if smoothing is None else smoothing,
        pngs=pngs or None,
    )
    out = Path(given["--out"][0]) if "--out" in given else None
    path, table = write(runs, out, options)
    if table is not None:
        print(text(table))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
