"""`asyncrl report A B C`: comparing runs. Labels from what differs in their configs, one colour per run in
every plot, wall time from the rows' `time`, the smoothing, the time-to-accuracy table, and the command's
one-line errors (nothing written)."""

from __future__ import annotations

import json
import re
import sys

import pytest

from asyncrl.core.errors import UserError
from asyncrl.report.curves import PLOTS, RunCurves, ema
from asyncrl.report.labels import PALETTE, colour, identities
from asyncrl.report.report import Options, write
from asyncrl.report.tta import rows, table, text
from asyncrl.transport.layout import RunLayout
from tests import warm

T0 = 1_800_000_000.0


def make_run(root, k: int, seed: int, rewards: list[float], evals: dict[int, float] | None = None, dt: float = 2.0):
    """A run dir as `rl` leaves it: configs that differ in k and seed (and the incidental dirs and ports)."""
    layout = RunLayout(root)
    for d in (layout.metrics, layout.logs, layout.configs):
        d.mkdir(parents=True)
    layout.pid_file("rl").write_text(json.dumps({"pid": 1, "host": "h", "started": T0, "ended": T0 + 99, "exit": 0}))
    orch = [
        {"step": s, "time": T0 + 10 + dt * s, "kind": "train", "reward/mean": r, "time/step": dt}
        for s, r in enumerate(rewards)
    ]
    orch += [
        {"step": s, "time": T0 + 11 + dt * s, "kind": "eval", "eval/reward/mean": r} for s, r in (evals or {}).items()
    ]
    trainer = [{"step": s, "time": T0 + 10 + dt * s, "loss": 1.0 / (s + 1)} for s in range(len(rewards))]
    layout.metrics_file("orchestrator").write_text("".join(json.dumps(r) + "\n" for r in orch))
    layout.metrics_file("trainer").write_text("".join(json.dumps(r) + "\n" for r in trainer))
    port = 8300 + seed  # a job's port: differs by construction, never a label
    for name in ("orchestrator", "trainer"):
        (layout.configs / f"{name}.toml").write_text(
            f'max_async_level = {k}\nseed = {seed}\noutput_dir = "{root}"\nmax_steps = 60\n\n[client]\nport = {port}\n'
        )
    return root


def test_labels_name_what_differs_and_groups_ignore_seeds(tmp_path):
    runs = [make_run(tmp_path / f"k{k}-s{s}" / "run", k, s, [0.5]) for k in (0, 1) for s in (1, 2)]
    ids = identities(runs)
    assert [i.label for i in ids] == ["k=0 seed=1", "k=0 seed=2", "k=1 seed=1", "k=1 seed=2"]
    assert [i.group for i in ids] == ["k=0", "k=0", "k=1", "k=1"]
    assert [i.colour for i in ids] == PALETTE[:4]
    assert [i.label for i in identities(runs, ["a", "b", "c", "d"])] == ["a", "b", "c", "d"]
    with pytest.raises(UserError, match="one --label per run"):
        identities(runs, ["a"])
    with open(runs[3] / "configs" / "trainer.toml", "a") as f:  # a field older configs lack is no difference
        f.write("\n[moe]\nreplay = false\n")
    assert [i.label for i in identities(runs)][3] == "k=1 seed=2"
    same = [make_run(tmp_path / d / "run", 1, 1, [0.5]) for d in ("x", "y")]  # no difference: the dir names
    assert [i.label for i in identities(same)] == ["run (x/run)", "run (y/run)"]


def test_twenty_runs_have_twenty_colours():
    assert len({colour(i) for i in range(20)}) == 20


def test_wall_time_is_the_rows_time_since_the_run_started_and_absent_without_it(tmp_path):
    run = make_run(tmp_path / "run", 0, 1, [0.1, 0.2, 0.3])
    (curve,) = RunCurves(run).curves(PLOTS[0])
    assert curve.steps == [0, 1, 2] and curve.wall == [10.0, 12.0, 14.0]  # rl.pid started at T0
    record = {"pid": 2, "host": "h", "started": T0 + 100, "exit": 0}  # resumed by a new rl: a newer rl.pid
    RunLayout(run).pid_file("rl").write_text(json.dumps(record))
    assert RunCurves(run).curves(PLOTS[0])[0].wall == [0.0, 2.0, 4.0]  # from its first row, never negative
    path = RunLayout(run).metrics_file("orchestrator")
    path.write_text(
        "".join(json.dumps({k: v for k, v in json.loads(x).items() if k != "time"}) + "\n" for x in open(path))
    )
    assert RunCurves(run).curves(PLOTS[0])[0].wall is None


def test_ema_is_debiased_and_weight_zero_is_the_raw_curve():
    assert ema([1.0, 1.0, 1.0], 0.9) == pytest.approx([1.0, 1.0, 1.0])  # not pulled toward 0 at the start
    assert ema([0.0, 1.0], 0.5) == pytest.approx([0.0, 2 / 3])
    assert ema([3.0, 1.0], 0.0) == [3.0, 1.0]


def _three(tmp_path, evals=None):
    rising = [0.1 * s for s in range(10)]
    return [
        make_run(tmp_path / "a" / "run", 0, 1, rising, evals and evals[0]),
        make_run(tmp_path / "b" / "run", 0, 2, [r * 0.8 for r in rising], evals and evals[1]),
        make_run(tmp_path / "c" / "run", 1, 1, [r * 0.5 for r in rising], evals and evals[2], dt=1.0),
    ]


def test_time_to_accuracy_defaults_to_the_smoothed_train_reward_and_the_worst_final(tmp_path):
    runs = _three(tmp_path, [{0: 0.1, 9: 0.5}] * 3)  # two evals (base, final) are no curve: train reward
    t = table([RunCurves(r) for r in runs], identities(runs), None, None)
    finals = [ema([f * 0.1 * s for s in range(10)])[-1] for f in (1.0, 0.8, 0.5)]
    assert t.metric == "reward/mean" and t.smoothed and t.threshold == pytest.approx(finals[2])
    assert [r.final for r in t.reaches] == pytest.approx(finals)
    assert [r.step for r in t.reaches][2] == 9  # the worst run reaches it at its last step
    first = t.reaches[0]
    assert first.step < 9 and first.wall == 10 + 2.0 * first.step
    mean, sd, n = t.group_final("k=0")
    assert n == 2 and mean == pytest.approx((finals[0] + finals[1]) / 2) and sd > 0
    assert rows(t)[3][-1].endswith("(n=1)") and "k=1 seed=1" in text(t)


def test_time_to_accuracy_uses_the_held_out_eval_when_every_run_has_a_curve_of_it(tmp_path):
    evals = [{0: 0.1, 4: 0.3, 9: 0.6}, {0: 0.1, 4: 0.5, 9: 0.5}, {0: 0.1, 4: 0.2, 9: 0.4}]
    runs = _three(tmp_path, evals)
    t = table([RunCurves(r) for r in runs], identities(runs), None, 0.45)
    assert t.metric == "eval/reward/mean" and not t.smoothed
    assert [(r.step, r.final) for r in t.reaches] == [(9, 0.6), (4, 0.5), (None, 0.4)]
    assert t.reaches[1].wall == 11 + 2.0 * 4
    with pytest.raises(UserError, match="no run logged the metric 'nope'"):
        table([RunCurves(r) for r in runs], identities(runs), "nope", None)


def test_the_page_gives_each_run_one_colour_in_every_plot_and_small_multiples_past_four_metrics(tmp_path):
    runs = _three(tmp_path, [{0: 0.1, 9: 0.5}] * 3)
    for run in runs:  # six rubric metrics: one chart each
        path = RunLayout(run).metrics_file("orchestrator")
        rows_ = [json.loads(x) | {f"metrics/m{i}": i for i in range(6)} for x in open(path)]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows_))
    out, t = write(runs, tmp_path / "cmp.html", Options(labels=["x", "y", "z"]))
    page = out.read_text()
    data = json.loads(re.search(r"id='report-data'>(.*?)</script>", page).group(1))
    assert [r["colour"] for r in data["runs"]] == PALETTE[:3] and [r["label"] for r in data["runs"]] == ["x", "y", "z"]
    rubric = next(p for p in data["plots"] if p["title"] == "rubric metrics")
    assert [c["title"] for c in rubric["charts"]] == [f"metrics/m{i}" for i in range(6)]
    smooth = {p["title"]: {c["smooth"] for c in p["charts"]} for p in data["plots"]}
    assert smooth["eval reward by step"] == {False} and smooth["reward"] == smooth["rubric metrics"] == {True}
    for plot in data["plots"]:
        for chart in plot["charts"]:
            assert sorted({s["run"] for s in chart["series"]}) == [0, 1, 2], chart["title"]
    assert "<table class='tta'>" in page and t is not None and len(t.reaches) == 3
    assert not (tmp_path / "cmp").exists()  # a comparison's PNGs only when asked for
    write(runs, tmp_path / "cmp.html", Options(pngs=True))
    assert len(list((tmp_path / "cmp").glob("*.png"))) == len(data["plots"])


def _cli(*args, cwd=None):
    cmd = [sys.executable, "-m", "asyncrl.entrypoints.asyncrl", *map(str, args)]
    return warm.run(cmd, capture_output=True, text=True, cwd=cwd)


def test_report_prints_its_table_and_bad_arguments_are_one_line_errors_writing_nothing(tmp_path):
    runs = _three(tmp_path)
    done = _cli("report", *runs, "--out", tmp_path / "ok.html", "--smoothing", "0.5")
    assert done.returncode == 0, done.stderr
    assert "time to EMA-smoothed reward/mean" in done.stdout and "k=1 seed=1" in done.stdout
    done = _cli("report", runs[0], "--threshold", "0.5")  # one run: its table when asked for
    assert done.returncode == 0 and "time to EMA-smoothed reward/mean ≥ 0.500" in done.stdout, done.stderr
    for args, said in [
        (["--smoothing", "2"], "--smoothing '2' is not a number from 0 to 0.99"),
        (["--threshold", "high"], "--threshold 'high' is not a number"),
        (["--label", "one"], "1 --label for 3 runs"),
        (["--metric", "nope"], "no run logged the metric 'nope'"),
        (["--out", "--out"], "--out needs a value"),
        (["--colour", "red"], "unknown option --colour"),
        (["--smoothing", "0.1", "--smoothing", "0.2"], "--smoothing given twice"),
    ]:
        tail = args[1:] if args[0] == "--out" else [*args, "--out", tmp_path / "bad.html"]
        done = _cli("report", *runs, *tail)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and said in lines[0], (args, done.stderr)
    assert not (tmp_path / "bad.html").exists() and not (tmp_path / "bad").exists()


def test_every_asyncrl_command_has_help():
    for args in (["--help"], ["status", "--help"], ["report", "--help"], ["report", "-h"]):
        done = _cli(*args)
        assert done.returncode == 0 and done.stdout.startswith("usage: "), (args, done.stderr)
    assert "--threshold X" in _cli("report", "--help").stdout
