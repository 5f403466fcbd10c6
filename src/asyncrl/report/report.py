"""`asyncrl report RUN_DIR [RUN_DIR ...]`: runs' curves as one self-contained, interactive HTML page, plus PNGs.

Reads only the runs' files: `metrics/{orchestrator,trainer,sft,eval}.jsonl`, the sample completions
(`samples.jsonl` of `rl`, `eval/rollouts.jsonl` of `eval`), `configs/*.toml` and what `asyncrl status`
reads. Writes `report.html` (plotly.js and the data inlined: zoom, hover, smoothing, step or wall-time
axis, run toggles; opens offline) and, for one run (or with `--png`), `report/<plot>.png` beside it (the
same curves, smoothed, for a README or a slide; a comparison's chart is saved from the page's camera
button instead: matplotlib takes seconds per plot there). Several runs: one colour per run in every plot,
labelled by what differs between their configs (labels.py), and a time-to-accuracy table (tta.py).

Invariants: a step logged twice (a crashed attempt, then a resumed one) counts once, the last row wins;
a run still going or one that crashed gives what it has (and its errors); a plot whose metrics no run has
is left out, never drawn empty; report.html is written whole (temp + rename) or not at all.
"""

from __future__ import annotations

import html
import io
import json
from dataclasses import dataclass
from pathlib import Path

from asyncrl.core.errors import UserError
from asyncrl.report import interactive, tta
from asyncrl.report.curves import PLOTS, SMOOTHING, Curve, Plot, RunCurves, ema, rows_by_step, smoothed
from asyncrl.report.labels import PALETTE, Identity, identities
from asyncrl.report.status import status_lines
from asyncrl.transport.files import write_text_atomic
from asyncrl.transport.layout import RunLayout

__all__ = ["PLOTS", "Options", "render_png", "report_at_end", "rows_by_step", "write_report"]


@dataclass(frozen=True)
class Options:
    labels: list[str] | None = None  # one per run; default: what differs between their configs
    metric: str | None = None  # the time-to-accuracy metric (tta.py says the default)
    threshold: float | None = None  # default: the worst run's final value
    smoothing: float = SMOOTHING  # the EMA weight the page opens with (and the PNGs and table use)
    pngs: bool | None = None  # report/<plot>.png too; default: for one run (a comparison's cost seconds)


MARGINS = {"left": 0.09, "right": 0.7, "bottom": 0.14, "top": 0.9}  # of the figure: the legend goes right of 0.7
STYLES = ["-", "--", ":", "-."]


def render_png(plot: Plot, per_run: list[list[Curve]], ids: list[Identity], smoothing: float = SMOOTHING):
    """The plot as PNG bytes: smoothed curves over the raw ones drawn faint; one run: a colour per metric;
    several: a colour per run, a line style per metric. None when no run has its metrics."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(dict.fromkeys(c.key for curves in per_run for c in curves))
    if not keys:
        return None
    # fixed margins, not tight_layout (which draws the figure once more to measure it), and light compression
    fig, ax = plt.subplots(figsize=(9, 3.4), dpi=100, gridspec_kw=MARGINS)
    several = len(ids) > 1
    for ident, curves in zip(ids, per_run):
        for c in curves:
            n = keys.index(c.key)
            colour, style = (ident.colour, STYLES[n % len(STYLES)]) if several else (PALETTE[n % len(PALETTE)], "-")
            ax.plot(c.steps, c.values, color=colour, linewidth=0.8, alpha=0.25)
            ax.plot(c.steps, ema(c.values, smoothing), style, color=colour, linewidth=1.6)
    ax.set_title(plot.title, fontsize=10)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend(handles=_legend(keys, ids), fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=False)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", pil_kwargs={"compress_level": 1})
    plt.close(fig)
    return buf.getvalue()


def _legend(keys: list[str], ids: list[Identity]) -> list:
    """One entry per run (its colour) and per metric (its line style), not one per pair."""
    from matplotlib.lines import Line2D

    if len(ids) == 1:
        return [Line2D([], [], color=PALETTE[n % len(PALETTE)], label=k) for n, k in enumerate(keys)]
    runs = [Line2D([], [], color=i.colour, label=i.label) for i in ids]
    styles = [Line2D([], [], color="#333", linestyle=STYLES[n % len(STYLES)], label=k) for n, k in enumerate(keys)]
    return runs + (styles if len(keys) > 1 else [])


def write_report(runs: list[Path], out: Path | None = None, options: Options | None = None) -> Path:
    """Write the report of `runs` (default: RUN/report.html for one run, ./report.html for several)."""
    return write(runs, out, options or Options())[0]


def write(runs: list[Path], out: Path | None, options: Options) -> tuple[Path, tta.Table | None]:
    """The report written, and its time-to-accuracy table (several runs only)."""
    for run in runs:
        status_lines(run)  # a dir that is no run: one clear error before anything is written
    ids = identities(runs, options.labels)
    curves = [RunCurves(run) for run in runs]
    asked = len(runs) > 1 or options.metric is not None or options.threshold is not None  # one run: if asked
    table = tta.table(curves, ids, options.metric, options.threshold) if asked else None
    out = out or (runs[0] / "report.html" if len(runs) == 1 else Path("report.html"))
    plots = []
    for plot in PLOTS:
        per_run = [rc.curves(plot) for rc in curves]
        if any(per_run):
            plots.append((plot, per_run))
    page = _page(runs, ids, plots, table, options)
    if options.pngs or (options.pngs is None and len(runs) == 1):
        _write_pngs(out.parent / out.stem, plots, ids, options.smoothing)
    write_text_atomic(out, page)
    return out, table


def _write_pngs(where: Path, plots: list[tuple[Plot, list[list[Curve]]]], ids: list[Identity], smoothing: float):
    where.mkdir(parents=True, exist_ok=True)
    for plot, per_run in plots:
        slug = "".join(c if c.isalnum() else "_" for c in plot.title.lower()).strip("_")
        (where / f"{slug}.png").write_bytes(render_png(plot, per_run, ids, smoothing if smoothed(plot) else 0.0))


def _page(runs, ids, plots, table, options: Options) -> str:
    esc = html.escape
    names = esc(", ".join(i.label for i in ids))
    charted = [(p, interactive.charts(p, per_run)) for p, per_run in plots]
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>asyncrl report: {names}</title>",
        f"<style>body{{font-family:sans-serif;margin:0 2em 2em;max-width:1600px}}{interactive.STYLE}"
        "pre{background:#f5f5f5;padding:.8em;overflow:auto;white-space:pre-wrap;max-height:20em}"
        ".sample{border-left:4px solid #bbb;padding-left:.8em;margin:1em 0}.sample h3{font-size:1em;margin:.2em 0}"
        ".sample h4{font-size:.8em;color:#777;margin:.4em 0 0}pre.prompt{color:#555}</style></head><body>",
        f"<h1>asyncrl report: {names}</h1>",
        interactive.controls(ids, options.smoothing) if plots else "",
        tta.to_html(table) if table else "",
    ]
    parts.append("<h2>Curves</h2>" if plots else "<p>No metrics yet: the run has not finished a step.</p>")
    parts += ["<div class='plots'>", *(interactive.figure(n, p, cs) for n, (p, cs) in enumerate(charted)), "</div>"]
    for run in runs:
        parts.append(f"<h2>{esc(str(run))}</h2><pre class='status'>{esc(chr(10).join(status_lines(run)))}</pre>")
    for run in runs:
        parts += _samples(run, len(runs) > 1)
    parts += _configs(runs)
    if plots:
        blob = interactive.blob(ids, charted, options.smoothing)
        parts.append(f"<script type='application/json' id='report-data'>{blob}</script>")
        parts.append(f"<script>{interactive.plotly_js()}</script><script>{interactive.report_js()}</script>")
    parts.append("</body></html>")
    return "\n".join(parts)


def _configs(runs: list[Path]) -> list[str]:
    esc = html.escape
    configs = [(run, c) for run in runs for c in sorted(RunLayout(run).configs.glob("*.toml"))]
    parts = ["<h2>Resolved configs</h2>"] if configs else []
    return parts + [
        f"<details><summary>{esc(str(c.relative_to(run.parent)))}</summary><pre>{esc(c.read_text())}</pre></details>"
        for run, c in configs
    ]


def _samples(run: Path, named_run: bool) -> list[str]:
    """Completions of the first and the last step (RL) or weights step (eval): the best and the worst by reward."""
    picks = [(f"step {r['step']}", r["best"], r["worst"]) for r in _ends(rows_by_step(RunLayout(run).samples, None))]
    evals = _eval_rows(run / "eval" / "rollouts.jsonl")
    for label in _ends(list(evals)):
        ok = evals[label]
        picks.append((f"eval {label}", max(ok, key=lambda r: r["reward"]), min(ok, key=lambda r: r["reward"])))
    if not picks:
        return []
    esc = html.escape
    out = [f"<h2>Samples{esc(' of ' + str(run)) if named_run else ''}</h2>"]
    for where, best, worst in picks:
        for which, s in (("best", best), ("worst", worst)):
            out.append(
                f"<div class='sample'><h3>{esc(where)}, {which}: reward {s['reward']:.3f} ({esc(s['env'])}, "
                f"example {s['example_id']})</h3><h4>prompt</h4><pre class='prompt'>{esc(s.get('prompt') or '')}</pre>"
                f"<h4>completion</h4><pre class='completion'>{esc(s.get('completion') or '')}</pre></div>"
            )
    return out


def _ends(items: list) -> list:
    return items[:1] + items[-1:] if len(items) > 1 else items


def _eval_rows(path: Path) -> dict[str, list[dict]]:
    """`eval`'s rollouts that did not fail, by target label, in the order they were evaluated."""
    by_label: dict[str, list[dict]] = {}
    if not path.exists():
        return by_label
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if not row.get("error"):
            text = row.get("prompt")
            row["prompt"] = text if isinstance(text, str) else _messages(text)
            row["completion"] = row.get("completion_text", "")
            by_label.setdefault(row["label"], []).append(row)
    return by_label


def _messages(messages: list | None) -> str:
    return "\n".join(f"[{m.get('role')}] {m.get('content') or ''}" for m in messages or [] if isinstance(m, dict))


def report_at_end(output_dir: str | Path) -> None:
    """An entrypoint's report of its run, whatever its outcome; one that cannot be written never hides the
    run's own error (a warning says why)."""
    from loguru import logger

    try:
        logger.info(f"report: {write_report([Path(output_dir)])}")
    except Exception as e:  # the report is an extra
        logger.warning(f"no report: {type(e).__name__}: {e}")


def check_runs(paths: list[str]) -> list[Path]:
    if not paths:
        raise UserError("asyncrl report takes one or more run directories, e.g. asyncrl report outputs/demo/rl")
    return [Path(p) for p in paths]
