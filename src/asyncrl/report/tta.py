"""The time-to-accuracy table: per run, the first step and wall time at which a metric reached a threshold.

The metric (higher is better): `--metric KEY` if given; else the held-out eval reward (`eval/reward/mean`)
when every run evaluated at least `EVAL_POINTS` times (a curve, not only the base and final weights); else
the train reward (`reward/mean`). Train metrics are EMA-smoothed (curves.ema, the report's smoothing), eval
ones are not (each point is already a mean over the held-out set). The threshold: `--threshold X`, else the
worst run's final value, so every run reaches it. The final value is the metric's last point; runs of one
config group (they differ only in seeds) give its mean ± sd. A run that lacks the metric is listed, `-`.
"""

from __future__ import annotations

import html
import statistics
from dataclasses import dataclass

from asyncrl.core.errors import UserError
from asyncrl.report.curves import Curve, RunCurves, ema
from asyncrl.report.labels import Identity

EVAL, TRAIN = ("orchestrator:eval", "eval/reward/mean"), ("orchestrator:train", "reward/mean")
EVAL_POINTS = 3


@dataclass(frozen=True)
class Reach:
    identity: Identity
    step: int | None  # None: never reached (or no metric)
    wall: float | None
    final: float | None


@dataclass(frozen=True)
class Table:
    metric: str
    smoothed: bool
    threshold: float | None
    reaches: list[Reach]

    def group_final(self, group: str) -> tuple[float, float, int]:
        finals = [r.final for r in self.reaches if r.identity.group == group and r.final is not None]
        sd = statistics.stdev(finals) if len(finals) > 1 else 0.0
        return (statistics.fmean(finals) if finals else float("nan")), sd, len(finals)


def choose_metric(runs: list[RunCurves], metric: str | None) -> tuple[str, str]:
    """(source, key) of the metric the table is about."""
    if metric is None:
        evals = [[r for r in run.rows(EVAL[0]) if EVAL[1] in r] for run in runs]
        return EVAL if all(len(e) >= EVAL_POINTS for e in evals) else TRAIN
    for source in ("orchestrator:eval", "orchestrator:train", "trainer", "eval", "sft"):
        if any(metric in row for run in runs for row in run.rows(source)):
            return source, metric
    raise UserError(
        f"no run logged the metric {metric!r}; pass --metric one of the metrics.jsonl keys, e.g. reward/mean"
    )


def table(runs: list[RunCurves], ids: list[Identity], metric: str | None, threshold: float | None) -> Table:
    source, key = choose_metric(runs, metric)
    smoothed = not source.endswith(":eval") and source != "eval"
    curves = [run.curve(source, key) for run in runs]
    curves = [Curve(c.key, c.steps, c.wall, ema(c.values)) if smoothed else c for c in curves]
    finals = [c.values[-1] for c in curves if c.values]
    if threshold is None and finals:
        threshold = min(finals)
    return Table(key, smoothed, threshold, [_reach(c, i, threshold) for c, i in zip(curves, ids)])


def _reach(curve: Curve, identity: Identity, threshold: float | None) -> Reach:
    final = curve.values[-1] if curve.values else None
    at = next((i for i, v in enumerate(curve.values) if threshold is not None and v >= threshold), None)
    if at is None:
        return Reach(identity, None, None, final)
    return Reach(identity, curve.steps[at], curve.wall[at] if curve.wall else None, final)


def _num(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def rows(t: Table) -> list[list[str]]:
    """The table's cells, header first: run, config group, step reached, wall s reached, final, group final."""
    out = [["run", "group", "step reached", "wall s reached", "final", "group final (mean ± sd, n)"]]
    for r in t.reaches:
        mean, sd, n = t.group_final(r.identity.group)
        group = f"{mean:.3f} ± {sd:.3f} (n={n})" if n else "-"
        out.append(
            [r.identity.label, r.identity.group, _num(r.step, "d"), _num(r.wall, ".0f"), _num(r.final, ".3f"), group]
        )
    return out


def caption(t: Table) -> str:
    how = "EMA-smoothed " if t.smoothed else ""
    return f"time to {how}{t.metric} ≥ {_num(t.threshold, '.3f')} (higher is better)"


def text(t: Table) -> str:
    cells = rows(t)
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    lines = [
        "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in cells
    ]
    return "\n".join([caption(t), lines[0], "-" * len(lines[0]), *lines[1:]])


def to_html(t: Table) -> str:
    esc = html.escape
    head, *body = rows(t)
    parts = [f"<table class='tta'><caption>{esc(caption(t))}</caption><tr>"]
    parts += [f"<th>{esc(h)}</th>" for h in head] + ["</tr>"]
    for r, cells in zip(t.reaches, body):
        swatch = f"<span class='swatch' style='background:{r.identity.colour}'></span>"
        parts.append(
            "<tr>" + "".join(f"<td>{swatch if i == 0 else ''}{esc(c)}</td>" for i, c in enumerate(cells)) + "</tr>"
        )
    return "".join(parts) + "</table>"
