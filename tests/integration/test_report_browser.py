"""The run report works in a real browser: headless Chromium opens `report.html`, every plot draws, and in a
comparison each run has one colour in every plot.

A run dir with metrics for every plot goes through `write_report`; Chromium (driven over the Chrome
DevTools Protocol) loads the page, every chart must be drawn by plotly.js under its plot's caption, the
sample completions present, no script error or console error logged; a full-page screenshot is saved. A
comparison of 3 runs is checked on the screenshot's pixels: each run's colour appears in every chart, and
none of a run switched off (the check can fail); smoothing and the wall-time axis change what is drawn. A
10-run comparison loads whole. Needs `chromium` (scripts/install_browser.sh).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from asyncrl.orchestrator.metrics import log_samples
from asyncrl.orchestrator.samples import Rollout
from asyncrl.report.curves import PLOTS, RunCurves, ema, rows_by_step
from asyncrl.report.report import write_report
from asyncrl.transport.layout import RunLayout
from asyncrl.utils.process import free_port

pytestmark = pytest.mark.slow
# the CDP client: websockets comes with the vLLM backend (scripts/install_vllm.sh, which scripts/test.sh runs)
connect = pytest.importorskip("websockets.sync.client", reason="no websockets: run scripts/install_vllm.sh").connect

ENVS = ("reverse_text", "gsm8k")
STEPS = 24


# --- a run dir with metrics for every plot ---------------------------------------------------------------


def _jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def make_run(run: Path, reward0: float = 0.2) -> Path:
    layout = RunLayout(run)
    for d in (layout.metrics, layout.logs, layout.configs):
        d.mkdir(parents=True)
    t0 = time.time() - STEPS * 10.0
    orch, trainer, sft = [], [], []
    for s in range(STEPS):
        t, r = t0 + 10.0 * s, reward0 + 0.6 * s / STEPS + 0.05 * ((s * 7) % 5 - 2)  # noisy
        env_rewards = {f"reward/{e}/mean": r + d for e, d in zip(ENVS, (0.05, -0.05))}
        moe = {"moe/load_max_over_mean": 1.6 - 0.01 * s, "moe/load_min_over_mean": 0.4, "moe/experts_idle_frac": 0.0}
        orch.append(
            {
                "step": s,
                "time": t,
                "kind": "train",
                "reward/mean": r,
                **env_rewards,
                "metrics/reverse_text/lcs_ratio": 0.5 + 0.4 * s / STEPS,
                "metrics/gsm8k/exact_match": r - 0.1,
                "off_policy/level": min(s, 2),
                "time/step": 9.5 + (s % 3) * 0.2,
                "time/rollouts": 7.0,
                "time/wait_weights": 1.2 if s else 0.0,
                "time/update_weights": 0.6,
                "time/pack_write": 0.3,
                "time/teacher_s": 0.4,
                "distill/teacher_kl": 0.12 * (1 - 0.5 * s / STEPS),  # a run with a teacher: its plot too
                "perf/gen_tokens_per_s": 2400.0 + 30 * s,
                "completion_len/mean": 180.0 - 2 * s,
                "completion_len/max": 512.0,
            }
        )
        if s % 8 == 0 or s == STEPS - 1:
            orch.append({"step": s, "time": t + 1, "kind": "eval", "eval/reward/mean": r - 0.02})
        trainer.append(
            {
                "step": s,
                "time": t + 5.0,
                "loss": 0.9 / (s + 1) ** 0.5,
                "entropy": 1.8 - 0.03 * s,
                "grad_norm": 0.4 + 0.1 * (s % 4),
                "mismatch_kl": 1e-3 * (1 + s % 5),
                "teacher_kl": 0.05 * (1 - 0.5 * s / STEPS),  # forward-KL distillation
                "masked_frac": 0.02 * (s % 3),
                "token_masked_high_frac": 0.01 * (s % 3),
                "importance_ratio/p01": 0.9 - 0.01 * (s % 3),
                "importance_ratio/p99": 1.1 + 0.01 * (s % 3),
                "step_time_s": 8.0,
                "wait_s": 1.5,
                "publish_s": 0.7,
                "off_policy/mean": 0.6 + 0.1 * (s % 3),
                "off_policy/max": 1.0 + (s % 2),
                "tokens_per_s": 5200.0 + 20 * s,
                **moe,  # a mixture of experts: its router load
            }
        )
        sft.append(
            {"step": s, "time": t, "loss": 2.5 / (s + 1), "grad_norm": 1.0 - 0.02 * s, "tokens_per_s": 8e3, **moe}
        )
    evals = [
        {"step": w, "time": t0 + 10.0 * w + 3, "label": f"step_{w}"}
        | {f"eval/{e}/reward_mean": 0.2 + w / 40 + d for e, d in zip(ENVS, (0, 0.1))}
        for w in (0, 8, 16, 24)
    ]
    _jsonl(layout.metrics_file("orchestrator"), orch)
    _jsonl(layout.metrics_file("trainer"), trainer)
    _jsonl(layout.metrics_file("sft"), sft)
    _jsonl(layout.metrics_file("eval"), evals)
    for s in range(STEPS):
        rollouts = [
            Rollout(
                env,
                example_id=10 * s + i,
                reward=min(1.0, 0.1 * i + 0.7 * s / STEPS),
                text=f"<think>step {s}, try {i}</think>\n<answer>{'x' * (40 * i)}</answer>",
                prompt_text=f"[system] env {env}\n[user] Reverse the text: 'hello & <world> {s}'",
            )
            for i, env in enumerate(ENVS * 2)
        ]
        log_samples(layout.samples, s, rollouts)
    for i, name in enumerate(("rl", "orchestrator", "trainer")):  # a run that finished
        record = {"pid": 1000 + i, "host": socket.gethostname(), "started": t0 + i, "ended": t0 + 250, "exit": 0}
        layout.pid_file(name).write_text(json.dumps(record))
    (layout.logs / "orchestrator.log").write_text("2024-01-01 00:00:00 | INFO | step 0 | reward 0.200\n")
    (layout.configs / "trainer.toml").write_text(f'max_steps = {STEPS}\n\n[model]\nname = "tiny-model"\n')
    return run


# --- a minimal Chrome DevTools Protocol client ------------------------------------------------------------


class Cdp:
    """One page's DevTools websocket: commands by incrementing id; every event received is kept in order."""

    def __init__(self, ws):
        self.ws, self.next_id, self.events = ws, 0, []

    def send(self, method: str, timeout: float = 60.0, **params) -> dict:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv(timeout=timeout))
            if msg.get("id") == self.next_id:
                assert "error" not in msg, f"{method}: {msg['error']}"
                return msg["result"]
            self.events.append(msg)

    def wait_event(self, method: str, timeout: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout
        while not any(e.get("method") == method for e in self.events):
            self.events.append(json.loads(self.ws.recv(timeout=max(0.01, deadline - time.monotonic()))))
        return next(e for e in self.events if e.get("method") == method)

    def open(self, path: Path) -> None:
        self.events.clear()
        self.send("Page.navigate", url=path.resolve().as_uri())
        self.wait_event("Page.loadEventFired")

    def evaluate(self, expression: str, timeout: float = 60.0):
        params = {"expression": expression, "returnByValue": True, "awaitPromise": True}
        result = self.send("Runtime.evaluate", timeout, **params)
        assert "exceptionDetails" not in result, result["exceptionDetails"]
        return result["result"]["value"]

    def errors(self) -> list[dict]:
        """Script exceptions and error-level log entries since the last `open`."""
        return [
            e
            for e in self.events
            if e.get("method") == "Runtime.exceptionThrown"
            or (e.get("method") == "Log.entryAdded" and e["params"]["entry"]["level"] == "error")
        ]


def _page_ws_url(port: int, proc: subprocess.Popen, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"chromium exited with code {proc.returncode}"
        try:
            targets = httpx.get(f"http://127.0.0.1:{port}/json", timeout=2.0).json()
            return next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")
        except (httpx.HTTPError, ValueError, StopIteration):
            time.sleep(0.2)
    raise TimeoutError(f"chromium's DevTools did not answer on port {port} within {timeout:.0f} s")


@pytest.fixture
def browser(tmp_path):
    chromium = shutil.which("chromium")
    if chromium is None:
        why = "chromium is not installed: bash scripts/install_browser.sh (Debian package chromium)"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    port, log = free_port(), (tmp_path / "chromium.log").open("wb")
    argv = [chromium, "--headless=new", "--no-sandbox", "--disable-gpu", f"--remote-debugging-port={port}"]
    argv += [f"--user-data-dir={tmp_path / 'chromium-profile'}", "--window-size=1400,1000", "about:blank"]
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        with connect(_page_ws_url(port, proc), max_size=None, open_timeout=30) as ws:
            cdp = Cdp(ws)
            for domain in ("Runtime", "Log", "Page"):
                cdp.send(f"{domain}.enable")
            yield cdp
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()


def screenshot(cdp: Cdp, path: Path) -> Path:
    """The whole page (the viewport grown to its height, no scrollbar) as a PNG."""
    cdp.send("Emulation.setScrollbarsHidden", hidden=True)
    height = cdp.evaluate("document.documentElement.scrollHeight")
    cdp.send("Emulation.setDeviceMetricsOverride", width=1400, height=height, deviceScaleFactor=1, mobile=False)
    path.write_bytes(base64.b64decode(cdp.send("Page.captureScreenshot", format="png")["data"]))
    return path


# --- the tests ----------------------------------------------------------------------------------------------

DRAWN = """window.asyncrlReport.drawAll().then(() => Array.from(document.querySelectorAll('div.chart'), d => ({
  plot: d.closest('figure').querySelector('figcaption').textContent, drawn: !!d.querySelector('svg.main-svg'),
  box: (r => [r.left + scrollX, r.top + scrollY, r.width, r.height])(d.getBoundingClientRect())})))"""


def comparison(root: Path, n: int) -> list[Path]:
    """`n` runs of one recipe at two async levels and several seeds: their configs differ in k and seed."""
    runs = []
    for i in range(n):
        run = make_run(root / f"k{i % 2}-s{i // 2}" / "run", reward0=0.1 + 0.04 * i)
        (RunLayout(run).configs / "orchestrator.toml").write_text(f"max_async_level = {i % 2}\nseed = {i // 2}\n")
        for path in RunLayout(run).metrics.glob("*.jsonl"):  # every curve of a run apart from the others'
            rows = [json.loads(line) for line in path.read_text().splitlines()]
            scaled = [{k: _apart(k, v, i) for k, v in r.items()} for r in rows]
            path.write_text("".join(json.dumps(r) + "\n" for r in scaled))
        runs.append(run)
    return runs


def _apart(key: str, value, i: int):
    number = isinstance(value, float | int) and not isinstance(value, bool)
    return value * (1 + 0.15 * i) + 0.01 * i if number and key not in ("step", "time") else value


def colour_counts(shot: Path, charts: list[dict], colours: list[str]) -> list[list[int]]:
    """Per chart, how many pixels are exactly each run's colour (a smoothed curve's own, drawn opaque)."""
    from PIL import Image

    image = Image.open(shot).convert("RGB")
    rgb = [tuple(int(c[i : i + 2], 16) for i in (1, 3, 5)) for c in colours]
    out = []
    for chart in charts:
        x, y, w, h = (round(v) for v in chart["box"])
        counts = {colour: n for n, colour in image.crop((x, y, x + w, y + h)).getcolors(maxcolors=1 << 20)}
        out.append([counts.get(c, 0) for c in rgb])
    return out


def test_every_plot_of_the_report_renders_in_chromium(tmp_path, browser):
    run = make_run(tmp_path / "run")
    curves = RunCurves(run)
    expected = [p.title for p in PLOTS if curves.curves(p)]
    assert len(expected) == len(PLOTS), "the run's metrics should cover every plot"
    report = write_report([run])

    browser.open(report)
    charts = browser.evaluate(DRAWN)
    assert list(dict.fromkeys(c["plot"] for c in charts)) == expected
    assert [c["plot"] for c in charts if not c["drawn"]] == [], "plots that did not render"
    assert browser.evaluate("document.querySelectorAll('div.sample').length") == 4  # first and last step
    completions = browser.evaluate("Array.from(document.querySelectorAll('pre.completion'), p => p.textContent)")
    assert any(c.startswith("<think>step 0") for c in completions)  # escaped, shown as text
    assert browser.evaluate("document.querySelector('pre.status').textContent").startswith(f"run {run}")
    assert browser.evaluate("document.querySelectorAll('details').length") == 1
    assert browser.errors() == []
    shot = screenshot(browser, tmp_path / "report.png")
    data = shot.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 20_000, len(data)
    print(f"\nreport screenshot: {shot} ({len(data) // 1024} KiB)")


def test_a_run_has_one_colour_in_every_plot_and_the_controls_work(tmp_path, browser):
    runs = comparison(tmp_path, 3)
    report = write_report(runs, tmp_path / "compare.html")
    browser.send("Emulation.setScrollbarsHidden", hidden=True)  # the width the screenshots have
    browser.open(report)
    labels = browser.evaluate("window.asyncrlReport.data.runs.map(r => r.label)")
    assert labels == ["k=0 seed=0", "k=1 seed=0", "k=0 seed=1"]
    colours = browser.evaluate("window.asyncrlReport.data.runs.map(r => r.colour)")
    charts = browser.evaluate(DRAWN)
    counts = colour_counts(screenshot(browser, tmp_path / "compare.png"), charts, colours)
    for chart, seen in zip(charts, counts):  # the screenshot: each run's colour in each chart
        assert all(n >= 20 for n in seen), (chart["plot"], seen)

    # the negative control: a run switched off leaves no pixel of its colour anywhere, the others stay
    browser.evaluate("document.querySelector('input[data-run=\"0\"]').click(); window.asyncrlReport.redraw()")
    counts = colour_counts(screenshot(browser, tmp_path / "compare-off.png"), browser.evaluate(DRAWN), colours)
    assert all(seen[0] == 0 and seen[1] >= 20 and seen[2] >= 20 for seen in counts), counts
    browser.evaluate("document.querySelector('input[data-run=\"0\"]').click(); window.asyncrlReport.redraw()")

    ys = "document.querySelector('div.chart').data.filter(t => t.hoverinfo !== 'skip')[0].y"
    raw = [r["reward/mean"] for r in rows_by_step(RunLayout(runs[0]).metrics_file("orchestrator"), "train")]
    assert browser.evaluate(ys) == pytest.approx(ema(raw, 0.8))  # the default smoothing, as curves.ema
    control = "(e => (e.value = '%s', e.dispatchEvent(new Event('%s'))))(document.getElementById('%s'))"
    browser.evaluate(control % ("0", "input", "smoothing") + " && window.asyncrlReport.redraw()")
    assert browser.evaluate(ys) == pytest.approx(raw)
    assert browser.evaluate("document.getElementById('smoothing-value').textContent") == "0"

    browser.evaluate(control % ("wall", "change", "axis") + " && window.asyncrlReport.redraw()")
    chart = "document.querySelector('div.chart')"
    assert browser.evaluate(f"{chart}.layout.xaxis.title.text") == "wall time (min)"
    xs = browser.evaluate(f"{chart}.data[0].x")
    assert xs[0] >= 0 and xs == sorted(xs) and 0 < xs[-1] < STEPS * 10 / 60 + 1  # minutes since the run started
    assert browser.errors() == []


def test_a_ten_run_comparison_loads_with_ten_colours(tmp_path, browser):
    runs = comparison(tmp_path, 10)
    report = write_report(runs, tmp_path / "ten.html")
    browser.send("Emulation.setScrollbarsHidden", hidden=True)
    browser.open(report)
    charts = browser.evaluate(DRAWN)
    assert charts and all(c["drawn"] for c in charts)
    colours = browser.evaluate("window.asyncrlReport.data.runs.map(r => r.colour)")
    assert len(set(colours)) == 10
    counts = colour_counts(screenshot(browser, tmp_path / "ten.png"), charts[:1], colours)  # the reward plot
    assert all(n > 0 for n in counts[0]), counts
    assert browser.errors() == []
    assert browser.evaluate("document.querySelectorAll('table.tta tr').length") == 11  # a header and 10 runs
