"""The report page's interactive plots: the curves as one JSON blob, drawn by plotly.js in the browser.

plotly.js (the `plotly` package's own `package_data/plotly.min.js`, found on disk, never imported) and
report.js (ours: smoothing, step / wall-time axis, run toggles, lazy drawing) are inlined, so the page
opens offline with no server. Invariants: a run is one colour everywhere (labels.Identity); a plot of
more than `MAX_STYLES` metrics becomes small multiples (one chart per metric), fewer share a chart and
differ by line style; a series is rounded to 5 significant digits of its largest value (wall times:
6); steps and wall times are stored once per run and source (`axes`); no `<` reaches a script raw.
"""

from __future__ import annotations

import html
import importlib.util
import json
import math
from pathlib import Path

from asyncrl.core.errors import UserError
from asyncrl.report.curves import SMOOTHING, Curve, Plot, smoothed
from asyncrl.report.labels import Identity

MAX_STYLES = 4  # solid, dash, dot, dash-dot
DASHES = ["", "6,4", "2,3", "8,3,2,3"]  # the same styles as report.js, for the key under a chart


def plotly_js() -> str:
    spec = importlib.util.find_spec("plotly")
    where = Path(next(iter(spec.submodule_search_locations or []), "")) if spec else None
    path = where / "package_data" / "plotly.min.js" if where else None
    if path is None or not path.is_file():
        raise UserError("the plotly package (its plotly.min.js) is missing: run bash scripts/setup.sh")
    return path.read_text(encoding="utf-8").replace("</script", "<\\/script")


def report_js() -> str:
    return (Path(__file__).parent / "report.js").read_text(encoding="utf-8")


def _round(values: list[float], digits: int = 5) -> list[float]:
    """To `digits` significant digits of the series' largest magnitude (what a plot of it can show)."""
    import numpy as np

    array = np.asarray(values, dtype=float)
    top = float(np.abs(array).max()) if len(array) else 0.0
    places = digits - 1 - math.floor(math.log10(top)) if top > 0 else 0
    return array.round(places).tolist()


def _series(run: int, dash: int, c: Curve) -> dict:
    wall = _round(c.wall, 6) if c.wall is not None else None
    return {"run": run, "key": c.key, "dash": dash, "x": c.steps, "t": wall, "y": _round(c.values)}


def _shared_axes(plots: list[tuple[Plot, list[dict]]]) -> list[dict]:
    """Move each series' steps and wall times into a shared list (a run's metrics share them): `axis` is the
    index there. Most of the page's size is then the values alone."""
    axes: dict[tuple, int] = {}
    for _, chart_list in plots:
        for chart in chart_list:
            for s in chart["series"]:
                x, t = s.pop("x"), s.pop("t")
                s["axis"] = axes.setdefault((tuple(x), tuple(t) if t is not None else None), len(axes))
    return [{"x": list(x), "t": list(t) if t is not None else None} for x, t in axes]


def charts(plot: Plot, per_run: list[list[Curve]]) -> list[dict]:
    """One chart, or one per metric key (small multiples) when the plot has more than MAX_STYLES keys."""
    keys = list(dict.fromkeys(c.key for curves in per_run for c in curves))
    groups = [keys] if len(keys) <= MAX_STYLES else [[k] for k in keys]
    out = []
    for group in groups:
        series = [_series(i, group.index(c.key), c) for i, cs in enumerate(per_run) for c in cs if c.key in group]
        title = group[0] if len(groups) > 1 else ""
        out.append({"title": title, "keys": group, "smooth": smoothed(plot), "series": series})
    return out


def blob(ids: list[Identity], plots: list[tuple[Plot, list[dict]]], smoothing: float) -> str:
    data = {
        "runs": [{"label": i.label, "colour": i.colour, "group": i.group} for i in ids],
        "smoothing": smoothing,
        "axes": _shared_axes(plots),
        "plots": [{"title": p.title, "charts": cs} for p, cs in plots],
    }
    return json.dumps(data, separators=(",", ":"), allow_nan=False).replace("<", "\\u003c")


def controls(ids: list[Identity], smoothing: float = SMOOTHING) -> str:
    esc = html.escape
    runs = "".join(
        f"<label class='run'><input type='checkbox' checked data-run='{n}'><span class='swatch' "
        f"style='background:{i.colour}'></span>{esc(i.label)}</label>"
        for n, i in enumerate(ids)
    )
    return (
        "<div class='controls'><label>smoothing (EMA) <input id='smoothing' type='range' min='0' max='0.99' "
        f"step='0.01' value='{smoothing}'> <output id='smoothing-value'>{smoothing}</output></label>"
        "<label>x axis <select id='axis'><option value='step'>step</option>"
        "<option value='wall'>wall time (min)</option></select></label>"
        f"<div class='runs'>{runs}</div></div>"
    )


def figure(n: int, plot: Plot, chart_list: list[dict]) -> str:
    esc = html.escape
    divs = "".join(
        f"<div class='chart' data-plot='{n}' data-chart='{j}'></div>{_key(c['keys'])}" for j, c in enumerate(chart_list)
    )
    wide = " multiples" if len(chart_list) > 1 else ""  # small multiples take a whole row
    caption = f"<figcaption>{esc(plot.title)}</figcaption>"
    return f"<figure class='plot{wide}'>{caption}<div class='charts'>{divs}</div></figure>"


def _key(keys: list[str]) -> str:
    """Which line style is which metric, under a chart of several."""
    if len(keys) < 2:
        return ""
    items = "".join(
        f"<span><svg width='28' height='8'><line x1='0' y1='4' x2='28' y2='4' stroke='#333' stroke-width='2' "
        f"stroke-dasharray='{DASHES[i]}'/></svg>{html.escape(k)}</span>"
        for i, k in enumerate(keys)
    )
    return f"<div class='key'>{items}</div>"


STYLE = (
    ".controls{position:sticky;top:0;z-index:5;background:#fff;padding:.5em 0;border-bottom:1px solid #ddd;"
    "display:flex;flex-wrap:wrap;gap:1.2em;align-items:center}.runs{display:flex;flex-wrap:wrap;gap:.3em 1em}"
    ".run{cursor:pointer;white-space:nowrap}.swatch{display:inline-block;width:.9em;height:.9em;margin:0 .3em;"
    "vertical-align:-.1em;border-radius:2px}"
    ".plots{display:grid;grid-template-columns:repeat(auto-fill,minmax(520px,1fr));grid-auto-flow:row dense;gap:1em}"
    "figure.plot{margin:0}figure.plot figcaption{font-weight:bold;margin:.3em 0}"
    "figure.multiples{grid-column:1/-1}"  # small multiples: a whole row, a grid of their own
    "figure.multiples .charts{display:grid;grid-template-columns:repeat(auto-fill,minmax(340px,1fr));gap:.5em}"
    ".chart{height:300px}.multiples .chart{height:240px}"
    ".key{font-size:.8em;color:#444;display:flex;flex-wrap:wrap;gap:.2em 1em}.key svg{margin-right:.3em}"
    "table.tta{border-collapse:collapse;margin:1em 0}table.tta caption{text-align:left;font-weight:bold;"
    "padding:.3em 0}table.tta td,table.tta th{border:1px solid #ddd;padding:.2em .6em;text-align:right}"
    "table.tta td:nth-child(-n+2){text-align:left}"
)
