"""What the test suite costs in CPU, from a run with ASYNCRL_TEST_CPU_LOG=PATH (tests/conftest.py).

    ASYNCRL_TEST_CPU_LOG=/tmp/cpu ./scripts/test.sh && python scripts/test_cpu.py /tmp/cpu [--top 40]

Prints the total CPU and wall seconds, each worker's span (first test's start to last test's end; one log file
per worker and session, so a CI run's two lanes show as their own workers) with the cores its tests kept busy,
the CPU by file and the costliest tests. CPU seconds do not grow with the machine's load as wall seconds do: the
total divided by the cores is the least wall time the suite can take.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def rows(prefix: Path) -> list[dict]:
    files = sorted(prefix.parent.glob(prefix.name + ".*"))
    if not files:
        raise SystemExit(f"error: no {prefix}.<pid> files: run the tests with ASYNCRL_TEST_CPU_LOG={prefix}")
    lines = [(f.suffix[1:], line) for f in files for line in f.read_text().splitlines() if line.strip()]
    return [dict(json.loads(line), worker=worker) for worker, line in lines]


def workers(tests: list[dict]) -> None:
    """Per worker: its tests, span, the wall its tests took, their CPU and CPU per second of span (rows written
    before the tests had a start time are left out)."""
    print("\n| worker | tests | span s | tests' wall s | CPU s | cores busy |\n|---|---|---|---|---|---|")
    for worker in sorted({r["worker"] for r in tests if "start" in r}):
        own = [r for r in tests if r["worker"] == worker and "start" in r]
        span = max(r["start"] + r["wall_s"] for r in own) - min(r["start"] for r in own)
        cpu = sum(r["cpu_s"] for r in own)
        wall = sum(r["wall_s"] for r in own)
        print(f"| {worker} | {len(own)} | {span:.0f} | {wall:.0f} | {cpu:.0f} | {cpu / max(span, 1e-9):.2f} |")


def table(title: str, items: list[tuple[str, float, float]], top: int) -> None:
    print(f"\n| {title} | CPU s | wall s |\n|---|---|---|")
    for name, cpu, wall in sorted(items, key=lambda x: -x[1])[:top]:
        print(f"| {name} | {cpu:.1f} | {wall:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prefix", type=Path)
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    tests = rows(args.prefix)
    by_file: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for r in tests:
        by_file[r["test"].split("::")[0]][0] += r["cpu_s"]
        by_file[r["test"].split("::")[0]][1] += r["wall_s"]
    cpu, wall = sum(r["cpu_s"] for r in tests), sum(r["wall_s"] for r in tests)
    print(f"{len(tests)} tests: {cpu:.0f} CPU s, {wall:.0f} wall s summed over workers")
    workers(tests)
    table("file", [(f, c, w) for f, (c, w) in by_file.items()], args.top)
    table("test", [(r["test"], r["cpu_s"], r["wall_s"]) for r in tests], args.top)


if __name__ == "__main__":
    main()
