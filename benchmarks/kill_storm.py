"""The kill storm: the CPU demo's RL run with a `kill -9` of a random process every ~15 s until it finishes.

Per seed, one undisturbed run and one storm run of the same config: the demo's (reverse-text from an SFT
warm-up, 16 prompts x 8, 60 steps, async level 1; `benchmarks/learning.py`'s cached warm-up and held-out
eval of the final weights on 200 examples of the env's eval split) with a checkpoint every `--interval` steps
and the env's episodes in an env server (so that it can be killed too). In the storm, once the current
attempt has trained a step, a thread waits 10-20 s (uniform, seeded) and SIGKILLs one live process drawn at
random: the inference server, the orchestrator, the trainer or the env server. rl restarts the run from its
latest checkpoint; the orchestrator restarts its env server in place. Meanwhile the process table is sampled
every 0.5 s: two live processes of one role at once, or any left after rl ends, is an orphan.

Prints one table: kills by component, restarts, steps redone, duplicated metrics rows, orphans, wall time and
the final held-out reward, storm against the undisturbed runs (mean, sd, range over seeds); numbers in
`{out}/kill_storm.json`.

    .venv/bin/python benchmarks/kill_storm.py [--seeds 3] [--interval 5] [--out outputs/kill_storm]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import tomli_w
from learning import BIN, TASKS, log, rl_config, summarize_run, warm

from asyncrl.report.status import last_row
from asyncrl.transport.layout import RunLayout
from asyncrl.utils import runstate
from asyncrl.utils.process import free_port, processes_by_role

ROLES = {"inference": "asyncrl.entrypoints.inference", "orchestrator": "asyncrl.entrypoints.orchestrator",
         "trainer": "asyncrl.entrypoints.trainer", "env-server": "asyncrl.entrypoints.env_server"}  # fmt: skip


def processes(out: Path) -> dict[str, list[int]]:
    """This run's live processes by role (`processes_by_role`: a fork before its `exec` is left out)."""
    by_role: dict[str, list[int]] = {r: [] for r in ROLES}
    for pid, (role, _) in processes_by_role(str(out), ROLES).items():
        by_role[role].append(pid)
    return by_role


class Storm:
    """Kills a random live process of the run every 10-20 s of training, and watches for orphans."""

    def __init__(self, proc: subprocess.Popen, out: Path, seed: int):
        self.proc, self.layout, self.rng = proc, RunLayout(out), random.Random(seed)
        self.kills: Counter = Counter()
        self.redone, self.orphans, self.last_kill = 0, 0, 0.0
        self.threads = [threading.Thread(target=f, daemon=True) for f in (self._kill_loop, self._census)]

    def __enter__(self) -> Storm:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        for t in self.threads:
            t.join(30)
        time.sleep(1)
        self.orphans += sum(map(len, processes(self.layout.root).values()))  # left after rl ended

    def _census(self) -> None:
        while self.proc.poll() is None:
            self.orphans += sum(len(pids) > 1 for pids in processes(self.layout.root).values())
            time.sleep(0.5)

    def _kill_loop(self) -> None:
        while self.proc.poll() is None:
            if not self._wait_for_training() or not self._sleep(self.rng.uniform(10, 20)):
                return
            live = {role: pids[0] for role, pids in processes(self.layout.root).items() if pids}
            if not live:
                continue
            role = self.rng.choice(sorted(live))
            before, last = self._restarts(), self._last_step()
            os.kill(live[role], signal.SIGKILL)
            self.kills[role] += 1
            self.last_kill = time.time()
            log(f"killed {role} (pid {live[role]}) after step {last}")
            if role != "env-server":
                self._count_redone(before, last)

    def _count_redone(self, before: int, last: int) -> None:
        """Once rl recorded the restart: the steps the run trains again (its last one, down to where it resumes)."""
        while self.proc.poll() is None and self._restarts() == before:
            time.sleep(0.2)
        if self._restarts() > before:
            self.redone += max(0, last + 1 - self._rl()["restarts"][-1]["from_step"])

    def _wait_for_training(self) -> bool:
        """Until the run has trained a step since the last kill and since rl's latest (re)start; False: rl ended."""
        while self.proc.poll() is None:
            row = last_row(self.layout.metrics_file("trainer"), kind="train")
            attempt = self._rl().get("attempt", self._rl().get("started", 0.0))
            if row is not None and row.get("time", 0.0) > max(attempt, self.last_kill):
                return True
            time.sleep(0.2)
        return False

    def _sleep(self, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        return self.proc.poll() is None

    def _rl(self) -> dict:
        return runstate.read(self.layout.pid_file("rl"))

    def _restarts(self) -> int:
        return len(self._rl().get("restarts") or [])

    def _last_step(self) -> int:
        row = last_row(self.layout.metrics_file("trainer"), kind="train")
        return row["step"] if row else -1


def duplicated_rows(out: Path) -> int:
    """Training steps logged more than once, over both metrics files."""
    dup = 0
    for name in ("orchestrator", "trainer"):
        path = RunLayout(out).metrics_file(name)
        steps = [json.loads(x)["step"] for x in path.read_text().splitlines() if x.strip() and '"eval' not in x]
        dup += len(steps) - len(set(steps))
    return dup


def run_one(model: Path, out: Path, seed: int, storm: bool, interval: int) -> dict:
    d = out / ("storm" if storm else "calm") / f"s{seed}"
    if (d / "result.json").exists():
        return json.loads((d / "result.json").read_text())
    subprocess.run(["rm", "-rf", str(d)], check=True)
    d.mkdir(parents=True)
    cfg = rl_config(TASKS["reverse"], model, eval_rollouts=1)
    cfg["orchestrator"]["env"][0]["server"] = {"restarts": 1000}
    cfg["orchestrator"]["eval"]["eval_base"] = False
    cfg["ckpt"] = {"interval": interval}
    (d / "rl.toml").write_text(tomli_w.dumps(cfg))
    cmd = [str(BIN / "rl"), "@", str(d / "rl.toml"), "--output-dir", str(d / "run"), "--max-async-level", "1"]
    cmd += ["--trainer.seed", str(seed), "--orchestrator.seed", str(seed), "--inference.server.port", str(free_port())]
    cmd += ["--restart-backoff", "1", "--no-report"]
    start = time.time()
    with open(d / "rl.log", "w") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT)
        with Storm(proc, d / "run", seed) if storm else _Calm() as watch:
            proc.wait()
    result = {"seed": seed, "storm": storm, "exit": proc.returncode, "wall_s": time.time() - start}
    if proc.returncode == 0:
        result.update(summarize_run(d / "run", result["wall_s"]), duplicated=duplicated_rows(d / "run"))
    result["restarts"] = len(runstate.read(RunLayout(d / "run").pid_file("rl")).get("restarts") or [])
    if storm:
        result.update(kills=dict(watch.kills), redone=watch.redone, orphans=watch.orphans)
    (d / "result.json").write_text(json.dumps(result, indent=1))
    return result


class _Calm:
    def __enter__(self) -> _Calm:
        return self

    def __exit__(self, *exc) -> None:
        pass


def table(calm: list[dict], storm: list[dict]) -> str:
    kills = Counter()
    for r in storm:
        kills.update(r.get("kills", {}))
    ok = [r for r in storm if r["exit"] == 0]
    rows = [
        ("runs finished with no human action", f"{len(ok)}/{len(storm)}", f"{_total(calm, 'exit', 0)}/{len(calm)}"),
        ("kills by component", ", ".join(f"{k} {v}" for k, v in sorted(kills.items())) or "-", "-"),
        ("restarts by rl", _total(storm, "restarts"), _total(calm, "restarts")),
        ("steps redone", _total(storm, "redone"), "0"),
        ("metrics rows duplicated", _total(ok, "duplicated"), _total(calm, "duplicated")),
        ("orphan sightings", _total(storm, "orphans"), "-"),
        ("wall (s), mean", f"{_mean(storm, 'wall_s'):.0f}", f"{_mean(calm, 'wall_s'):.0f}"),
        ("final held-out reward", _msd(ok), _msd(calm)),
    ]
    lines = ["| | kill storm | undisturbed |", "| --- | --- | --- |"]
    return "\n".join(lines + [f"| {a} | {b} | {c} |" for a, b, c in rows])


def _total(results: list[dict], key: str, equal: int | None = None) -> str:
    """The sum of `key` over `results` (with `equal`: how many have that value)."""
    values = [r.get(key, 0) for r in results]
    return str(sum(v == equal for v in values) if equal is not None else sum(values))


def _mean(results: list[dict], key: str) -> float:
    return statistics.fmean(r[key] for r in results) if results else float("nan")


def _msd(results: list[dict]) -> str:
    """Mean ± sd [min, max] of the final held-out reward of the runs that have one."""
    values = [r["heldout_after"] for r in results if "heldout_after" in r]
    if not values:
        return "-"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.3f} ± {sd:.3f} [{min(values):.3f}, {max(values):.3f}]"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--interval", type=int, default=5, help="checkpoint every N steps")
    ap.add_argument("--out", type=Path, default=Path("outputs/kill_storm"))
    args = ap.parse_args(argv)
    model = warm("reverse", TASKS["reverse"], Path("outputs/learning"))
    calm, storm = [], []
    for seed in range(1, args.seeds + 1):
        for disturbed, into in ((False, calm), (True, storm)):
            r = run_one(model.resolve(), args.out.resolve(), seed, disturbed, args.interval)
            into.append(r)
            held = r.get("heldout_after", float("nan"))
            what = "storm" if disturbed else "calm"
            log(f"seed {seed} {what}: exit {r['exit']}, {r['wall_s']:.0f}s, held-out {held:.3f}, "
                f"restarts {r['restarts']}, kills {r.get('kills')}")  # fmt: skip
    text = table(calm, storm)
    (args.out / "kill_storm.json").write_text(json.dumps({"calm": calm, "storm": storm}, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
