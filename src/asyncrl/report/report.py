"""`asyncrl report RUN_DIR [RUN_DIR ...]`: a run's curves as one self-contained HTML page, plus PNGs.

Reads only the run's files: `metrics/{orchestrator,trainer,sft,eval}.jsonl`, the sample completions
(`samples.jsonl` of `rl`, `eval/rollouts.jsonl` of `eval`), `configs/*.toml` and what `asyncrl status`
reads. Writes `report.html` (plots embedded as PNG data, viewable offline) and `report/<plot>.png` beside it.
Several runs: their curves overlaid in one page (an ablation).

Invariants: a step logged twice (a crashed attempt, then a resumed one) counts once, the last row wins;
a run still going or one that crashed gives what it has (and its errors); a plot whose metrics no run has
is left out, never drawn empty.
"""

from __future__ import annotations

import base64
import html
import io
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from asyncrl.core.errors import UserError
from asyncrl.report.status import status_lines
from asyncrl.transport.files import write_text_atomic
from asyncrl.transport.layout import RunLayout


@dataclass(frozen=True)
class Plot:
    title: str
    source: str  # metrics file (orchestrator / trainer / sft), `kind` rows after ':' (orchestrator:eval)
    keys: Callable[[set[str]], list[str]]  # the metric keys to draw, from the keys the rows have


def named(*keys: str) -> Callable[[set[str]], list[str]]:
    return lambda have: [k for k in keys if k in have]


def prefixed(prefix: str, suffix: str = "") -> Callable[[set[str]], list[str]]:
    return lambda have: sorted(k for k in have if k.startswith(prefix) and k.endswith(suffix))


def per_env(have: set[str]) -> list[str]:
    """Each environment's mean reward, when there are several (one is the same curve as reward/mean)."""
    envs = [k for k in prefixed("reward/", "/mean")(have) if k != "reward/mean"]
    return envs if len(envs) > 1 else []


def masked_fractions(have: set[str]) -> list[str]:
    """Every `*_frac` the loss logged: masked_frac first, then each side of each mask, clip and truncation."""
    fracs = sorted(k for k in have if k.endswith("_frac") and "/" not in k and k != "masked_frac")
    return named("masked_frac")(have) + fracs


PLOTS = [
    Plot("reward", "orchestrator:train", lambda have: named("reward/mean")(have) + per_env(have)),
    Plot("rubric metrics", "orchestrator:train", prefixed("metrics/")),
    Plot("eval reward by step", "orchestrator:eval", prefixed("eval/reward/")),
    Plot("off-policy level (steps behind)", "orchestrator:train", named("off_policy/level")),
    Plot(
        "distillation: KL to the teacher (sampler_lp - teacher_lp)", "orchestrator:train", named("distill/teacher_kl")
    ),
    Plot(
        "orchestrator step time (s)",
        "orchestrator:train",
        named(
            "time/step",
            "time/rollouts",
            "time/teacher_s",
            "time/wait_weights",
            "time/update_weights",
            "time/pack_write",
        ),
    ),
    Plot("generation tokens/s", "orchestrator:train", named("perf/gen_tokens_per_s")),
    Plot("completion length", "orchestrator:train", named("completion_len/mean", "completion_len/max")),
    Plot("staleness of trained samples (steps behind)", "trainer", named("off_policy/mean", "off_policy/max")),
    Plot("trainer loss", "trainer", named("loss")),
    Plot("entropy", "trainer", named("entropy")),
    Plot("grad norm", "trainer", named("grad_norm")),
    Plot(
        "KL to the sampler (mismatch_kl) and to the start weights (ref_kl)", "trainer", named("mismatch_kl", "ref_kl")
    ),
    Plot("forward-KL distillation: KL(teacher's top-k ‖ student)", "trainer", named("teacher_kl")),
    Plot("importance ratio π/μ (quantiles, max)", "trainer", prefixed("importance_ratio/")),
    Plot("masked / clipped / truncated fraction, by side", "trainer", masked_fractions),
    Plot("MoE router load (tokens per expert / mean, layers averaged; idle experts)", "trainer", prefixed("moe/")),
    Plot("trainer step time (s)", "trainer", named("step_time_s", "wait_s", "publish_s")),
    Plot("trainer tokens/s", "trainer", named("tokens_per_s")),
    Plot("eval reward by weights step (eval)", "eval", prefixed("eval/", "/reward_mean")),
    Plot("SFT loss", "sft", named("loss")),
    Plot("SFT grad norm", "sft", named("grad_norm")),
    Plot("SFT tokens/s", "sft", named("tokens_per_s")),
    Plot("SFT MoE router load (tokens per expert / mean, layers averaged; idle experts)", "sft", prefixed("moe/")),
]


def rows_by_step(path: Path, kind: str | None) -> list[dict]:
    """A metrics file's rows (of `kind`), one per step (the last one logged), by step; unreadable lines skipped."""
    if not path.exists():
        return []
    by_step: dict[int, dict] = {}
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # a line being written
            continue
        if kind is None or row.get("kind", kind) == kind:
            by_step[row["step"]] = row
    return [by_step[s] for s in sorted(by_step)]


def _series(run: Path, plot: Plot) -> dict[str, tuple[list[int], list[float]]]:
    name, _, kind = plot.source.partition(":")
    rows = rows_by_step(RunLayout(run).metrics_file(name), kind or None)
    have = {k for r in rows for k, v in r.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    out = {}
    for key in plot.keys(have):
        points = [(r["step"], float(r[key])) for r in rows if isinstance(r.get(key), (int, float))]
        out[key] = ([s for s, _ in points], [v for _, v in points])
    return out


MARGINS = {"left": 0.09, "right": 0.98, "bottom": 0.14, "top": 0.9}  # of the figure: room for the tick labels


def render_png(plot: Plot, runs: list[Path]) -> bytes | None:
    """The plot as PNG bytes, every run's every key a line; None when no run has its metrics."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = [(run, key, xy) for run in runs for key, xy in _series(run, plot).items() if xy[0]]
    if not lines:
        return None
    # fixed margins, not tight_layout (which draws the figure once more to measure it), and light compression:
    # 1.66 -> 1.05 s of CPU for a run's 14 plots; every `rl` pays it as it ends
    fig, ax = plt.subplots(figsize=(7, 3.4), dpi=100, gridspec_kw=MARGINS)
    for run, key, (x, y) in lines:
        label = " ".join(p for p in (run.name if len(runs) > 1 else "", key) if p)
        ax.plot(x, y, marker="o" if len(x) < 30 else None, markersize=3, linewidth=1.4, label=label)
    ax.set_title(plot.title)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    if len(lines) > 1:
        ax.legend(fontsize=8, loc="best")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", pil_kwargs={"compress_level": 1})
    plt.close(fig)
    return buf.getvalue()


def write_report(runs: list[Path], out: Path | None = None) -> Path:
    """Write the report of `runs` (default: RUN/report.html for one run, ./report.html for several)."""
    for run in runs:
        status_lines(run)  # a dir that is no run: one clear error before anything is written
    out = out or (runs[0] / "report.html" if len(runs) == 1 else Path("report.html"))
    pngs = out.parent / out.stem
    pngs.mkdir(parents=True, exist_ok=True)
    figures = []
    for plot in PLOTS:
        png = render_png(plot, runs)
        if png is None:
            continue
        slug = "".join(c if c.isalnum() else "_" for c in plot.title.lower()).strip("_")
        (pngs / f"{slug}.png").write_bytes(png)
        figures.append((plot.title, base64.b64encode(png).decode()))
    write_text_atomic(out, _page(runs, figures))
    return out


def _page(runs: list[Path], figures: list[tuple[str, str]]) -> str:
    esc = html.escape
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>asyncrl report: {esc(', '.join(r.name for r in runs))}</title>",
        "<style>body{font-family:sans-serif;margin:2em;max-width:1500px}"
        ".plots{display:grid;grid-template-columns:repeat(auto-fill,minmax(520px,1fr));gap:1em}"
        "figure{margin:0}img.plot{width:100%;height:auto}"
        "figcaption{position:absolute;left:-9999px}"  # the title is in the image; the caption is for screen readers
        "pre{background:#f5f5f5;padding:.8em;overflow:auto;white-space:pre-wrap;max-height:20em}"
        ".sample{border-left:4px solid #bbb;padding-left:.8em;margin:1em 0}.sample h3{font-size:1em;margin:.2em 0}"
        ".sample h4{font-size:.8em;color:#777;margin:.4em 0 0}pre.prompt{color:#555}</style></head><body>",
        f"<h1>asyncrl report: {esc(', '.join(r.name for r in runs))}</h1>",
    ]
    for run in runs:
        parts.append(f"<h2>{esc(str(run))}</h2><pre class='status'>{esc(chr(10).join(status_lines(run)))}</pre>")
    parts.append("<h2>Curves</h2>" if figures else "<p>No metrics yet: the run has not finished a step.</p>")
    parts.append("<div class='plots'>")
    parts += [
        f"<figure><img class='plot' alt='{esc(t)}' src='data:image/png;base64,{b64}'><figcaption>{esc(t)}"
        "</figcaption></figure>"
        for t, b64 in figures
    ]
    parts.append("</div>")
    for run in runs:
        parts += _samples(run, len(runs) > 1)
    configs = [(run, c) for run in runs for c in sorted(RunLayout(run).configs.glob("*.toml"))]
    parts.append("<h2>Resolved configs</h2>" if configs else "")
    parts += [
        f"<details><summary>{esc(str(c.relative_to(run.parent)))}</summary><pre>{esc(c.read_text())}</pre></details>"
        for run, c in configs
    ]
    parts.append("</body></html>")
    return "\n".join(parts)


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
