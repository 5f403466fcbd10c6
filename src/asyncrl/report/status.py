"""`asyncrl status RUN_DIR`: where a running or finished run is, from its files alone.

Reads only what the processes write (`logs/<component>.pid` records, `metrics/*.jsonl`, `configs/*.toml`,
`logs/*.log`), so it works on a run still going, a finished one, a crashed one, or one on a shared disk.
Per process: alive / finished / failed (with its error) / killed; the last step, reward or loss and
throughput; the orchestrator's off-policy lag; the restarts `rl` made (what died, why, from which step);
the last error lines of the logs. A multi-run dir adds one
line per run (`run_NAME/`): done / stopped / failed (its error under errors) / training, its last step.
"""

from __future__ import annotations

import json
import time
import tomllib
from pathlib import Path

from asyncrl.core.errors import UserError
from asyncrl.transport.layout import RunLayout
from asyncrl.utils import runstate

TAIL_BYTES = 1 << 16  # the last rows of a metrics file are in its last 64 KiB


def status_lines(run_dir: Path) -> list[str]:
    layout = RunLayout(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"{run_dir} is not a directory; pass a run's output_dir (e.g. outputs/demo/rl)")
    if not layout.logs.is_dir() and not layout.metrics.is_dir():
        raise UserError(f"{run_dir} has no logs/ or metrics/: it is not a run's output_dir")
    max_steps, header = _config(layout)
    names = sorted({p.stem for p in layout.logs.glob("*.pid")} | {p.stem for p in layout.metrics.glob("*.jsonl")})
    lines = [f"run {run_dir}{header}"]
    rl = runstate.read(layout.pid_file("rl"))
    attempt = rl.get("attempt", rl.get("started", 0.0))  # when `rl` last (re)started the run
    lines += [_component_line(layout, name, max_steps, attempt) for name in names]
    lines += _restarts_lines(rl)
    runs = {name: _ended(layout, name) for name in layout.run_names()}  # multi-run: each run's own line
    lines += [_run_line(layout, name, ended) for name, ended in runs.items()]
    errors = _errors(layout, names) + [f"run {n}: {e['error']}" for n, e in runs.items() if e.get("state") == "failed"]
    lines.append("errors: none" if not errors else "errors:")
    lines += [f"  {e}" for e in errors]
    return lines


def _config(layout: RunLayout) -> tuple[int | None, str]:
    for name in ("trainer", "sft", "orchestrator"):
        path = layout.configs / f"{name}.toml"
        if path.exists():
            cfg = tomllib.loads(path.read_text())
            model = cfg.get("model", {}).get("name")
            return cfg.get("max_steps"), f": model {model}, max_steps {cfg.get('max_steps') or 'unbounded'}"
    return None, ""


def _component_line(layout: RunLayout, name: str, max_steps: int | None, attempt: float) -> str:
    record = runstate.read(layout.pid_file(name))
    state = runstate.state(record) if record else "-"
    if record and record["started"] < attempt and name != "rl":  # rl itself made the attempts
        state = f"{state}, earlier attempt"
    row = last_row(layout.metrics_file(name), kind="train")
    parts = [f"  {name:<13} {state:<22}"]
    if row:
        of = f"/{max_steps}" if max_steps and name in STEPPED else ""  # eval's steps are weights steps
        parts.append(f"step {row['step']}{of}")
        parts += [f"{label} {fmt.format(row[key])}" for key, label, fmt in SHOWN if row.get(key) is not None]
        parts.append(f"({_ago(row.get('time'))})")
    return "  ".join(parts).rstrip()


def _restarts_lines(rl: dict) -> list[str]:
    """`  restarts      2: trainer (exit code -9: SIGKILL) from step 10, 3 min ago; ...`: rl's own restarts."""
    done = rl.get("restarts") or []
    if not done:
        return []
    said = [f"{d['component']} ({d['why']}) from step {d['from_step']}, {_ago(d.get('time'))}" for d in done[-3:]]
    return [f"  {'restarts':<13} {len(done)}" + (" (the last 3)" if len(done) > 3 else "") + ": " + "; ".join(said)]


def _ended(layout: RunLayout, name: str) -> dict:
    """How the trainer ended run `name` (its run_status.json), or {} while it has not."""
    path = layout.run(name).run_status
    return json.loads(path.read_text()) if path.exists() else {}


def _run_line(layout: RunLayout, name: str, ended: dict) -> str:
    """`  run NAME  done  step 59  reward 0.208 ...`: a multi-run run, from its own dir's files."""
    run = layout.run(name)
    state = ended.get("state") or ("training" if run.metrics_file("trainer").exists() else "waiting for a slot")
    row = last_row(run.metrics_file("orchestrator"), kind="train")
    parts = [f"  run {name:<9} {state:<22}"]
    if row:
        parts.append(f"step {row['step']}")
        parts += [f"{label} {fmt.format(row[key])}" for key, label, fmt in SHOWN if row.get(key) is not None]
        parts.append(f"({_ago(row.get('time'))})")
    return "  ".join(parts).rstrip()


STEPPED = ("orchestrator", "trainer", "sft")  # the processes that count steps up to max_steps

SHOWN = [  # metrics shown per component when present: key, label, format
    ("reward/mean", "reward", "{:.3f}"),
    ("off_policy/level", "off-policy", "{:.0f}"),
    ("loss", "loss", "{:.4f}"),
    ("tokens_per_s", "tok/s", "{:,.0f}"),
    ("perf/gen_tokens_per_s", "gen tok/s", "{:,.0f}"),
]


def last_row(path: Path, kind: str | None = None) -> dict | None:
    """The last complete JSON row of a metrics file (of `kind` where rows have one), or None."""
    if not path.exists():
        return None
    with path.open("rb") as f:
        f.seek(max(0, path.stat().st_size - TAIL_BYTES))
        lines = f.read().decode(errors="replace").splitlines()
    for line in reversed(lines):
        try:
            row = json.loads(line)
        except ValueError:  # the first (cut) line, or one being written
            continue
        if kind is None or row.get("kind", kind) == kind:
            return row
    return None


def _ago(t: float | None) -> str:
    if t is None:
        return "time unknown"
    s = max(0.0, time.time() - t)
    return f"{s:.0f} s ago" if s < 120 else f"{s / 60:.0f} min ago" if s < 7200 else f"{s / 3600:.1f} h ago"


def _errors(layout: RunLayout, names: list[str], last: int = 5) -> list[str]:
    """Each process's recorded error, then the last ERROR lines of the logs."""
    records = [(n, runstate.read(layout.pid_file(n))) for n in names]
    found = [f"{n}: {r['error'].splitlines()[0]}" for n, r in records if r.get("error")]  # details: in the logs
    for log in sorted(layout.logs.glob("*.log")):
        bad = [line.strip() for line in log.read_text(errors="replace").splitlines() if " ERROR " in line]
        found += [f"{log.name}: {line}" for line in bad[-last:]]
    return found
