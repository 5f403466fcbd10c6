"""`asyncrl report`: runs' curves in one offline HTML page (plus PNGs), on run dirs made here: what is plotted,
who is who (labels, colours, groups), the time-to-accuracy table and the command line's errors."""

from __future__ import annotations

import json
import re
import sys

from asyncrl.report.curves import PLOTS, RunCurves, rows_by_step
from asyncrl.report.report import write_report
from asyncrl.transport.layout import RunLayout
from tests import warm


def make_run(root, steps: int, reward0: float = 0.2, crashed_at: int | None = None):
    layout = RunLayout(root)
    layout.metrics.mkdir(parents=True)
    layout.logs.mkdir()
    orch, trainer = [], []
    for s in range(steps):
        orch.append(
            {
                "step": s,
                "kind": "train",
                "reward/mean": reward0 + 0.01 * s,
                "reward/a/mean": 0.1,
                "reward/b/mean": 0.3,
                "off_policy/level": 1,
                "metrics/a/exact": 0.5,
                "time/step": 0.4,
            }
        )
        trainer.append(
            {
                "step": s,
                "loss": 1.0 / (s + 1),
                "entropy": 2.0,
                "grad_norm": 0.5,
                "tokens_per_s": 900.0,
                "off_policy/mean": 0.5,
            }
        )
    orch.append({"step": 2, "kind": "eval", "eval/reward/mean": 0.4})
    if crashed_at is not None:  # a crashed attempt logged step 1 once already; the resumed one logs it again
        orch.insert(crashed_at, {**orch[1], "reward/mean": -5.0})
    layout.metrics_file("orchestrator").write_text("".join(json.dumps(r) + "\n" for r in orch))
    layout.metrics_file("trainer").write_text("".join(json.dumps(r) + "\n" for r in trainer) + '{"step": 9, "lo')
    return root


def test_a_step_logged_twice_counts_once_the_last_row_wins(tmp_path):
    run = make_run(tmp_path / "run", 4, crashed_at=1)
    rows = rows_by_step(RunLayout(run).metrics_file("orchestrator"), "train")
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and rows[1]["reward/mean"] != -5.0
    assert [r["step"] for r in rows_by_step(RunLayout(run).metrics_file("trainer"), None)] == [0, 1, 2, 3]


def test_report_of_a_run_is_one_offline_page_with_every_plot_it_has_data_for(tmp_path):
    run = make_run(tmp_path / "run", 5)
    (RunLayout(run).logs / "rl.pid").write_text(
        json.dumps({"pid": 1, "host": "h", "started": 0, "exit": 2, "error": "trainer died (exit code -9)"})
    )
    page = write_report([run]).read_text()
    titles = re.findall(r"<figcaption>(.*?)</figcaption>", page)
    assert titles == [
        "reward",
        "rubric metrics",
        "eval reward by step",
        "off-policy level (steps behind)",
        "orchestrator step time (s)",
        "staleness of trained samples (steps behind)",
        "trainer loss",
        "entropy",
        "grad norm",
        "trainer tokens/s",
    ]
    assert page.count("<div class='chart' ") == len(titles)  # one chart each: no plot here has 5+ metrics
    assert not re.search(r"<(script|img|link)[^>]* (src|href)=", page)  # nothing to fetch: it opens offline
    assert "rl: trainer died (exit code -9)" in page  # a crashed run shows its error
    assert len(list((run / "report").glob("*.png"))) == len(titles)


def test_a_plot_without_data_is_left_out_and_an_empty_run_says_so(tmp_path):
    run = make_run(tmp_path / "run", 0)
    assert all(RunCurves(run).curves(p) == [] for p in PLOTS if p.source != "orchestrator:eval")
    assert "No metrics yet" not in write_report([run]).read_text()  # the one eval row is a curve
    (RunLayout(run).metrics_file("orchestrator")).write_text("")
    assert "No metrics yet" in write_report([run]).read_text()


def test_a_distillation_run_plots_its_kl_to_the_teacher(tmp_path):
    run = make_run(tmp_path / "run", 3)
    path = RunLayout(run).metrics_file("orchestrator")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for r in rows:
        if r["kind"] == "train":
            r.update({"distill/teacher_kl": 1.0 / (r["step"] + 1), "distill/teacher_lp": -2.0, "time/teacher_s": 0.1})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    titles = re.findall(r"<figcaption>(.*?)</figcaption>", write_report([run]).read_text())
    assert "distillation: KL to the teacher (sampler_lp - teacher_lp)" in titles
    assert titles.index("distillation: KL to the teacher (sampler_lp - teacher_lp)") == titles.index("reward") + 4


def test_several_runs_are_overlaid_in_one_page(tmp_path):
    a, b = make_run(tmp_path / "a", 3), make_run(tmp_path / "b", 3, reward0=0.6)
    done = warm.run(
        [
            sys.executable,
            "-m",
            "asyncrl.entrypoints.asyncrl",
            "report",
            str(a),
            str(b),
            "--out",
            str(tmp_path / "c.html"),
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    page = (tmp_path / "c.html").read_text()
    assert page.count("<pre class='status'>") == 2 and not (tmp_path / "c").exists()  # PNGs: with --png


def _sample(reward: float, text: str) -> dict:
    return {"env": "a", "example_id": 7, "reward": reward, "advantage": 0.0, "prompt": "[user] hi", "completion": text}


def test_samples_of_the_first_and_last_step_best_and_worst(tmp_path):
    from asyncrl.orchestrator.metrics import log_samples
    from asyncrl.orchestrator.samples import Rollout

    run = make_run(tmp_path / "run", 3)
    layout = RunLayout(run)
    for step in range(3):
        rollouts = [Rollout("a", i, reward=0.1 * i + step, text=f"<s{step} r{i}>") for i in range(4)]
        log_samples(layout.samples, step, rollouts)
    log_samples(layout.samples, 2, [])  # nothing valid: no row
    page = write_report([run]).read_text()
    shown = re.findall(r"<h3>(.*?): reward", page)
    assert shown == ["step 0, best", "step 0, worst", "step 2, best", "step 2, worst"]
    assert "&lt;s0 r3&gt;" in page and "&lt;s0 r0&gt;" in page and "&lt;s2 r3&gt;" in page  # escaped text
    assert "s1 r" not in page


def test_eval_dir_report_has_reward_by_weights_step_and_its_samples(tmp_path):
    run = tmp_path / "evalrun"
    layout = RunLayout(run)
    layout.metrics.mkdir(parents=True)
    rows = [{"step": s, "label": lbl, "eval/a/reward_mean": r} for s, lbl, r in [(0, "base", 0.1), (5, "step_5", 0.6)]]
    layout.metrics_file("eval").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "eval").mkdir()
    rollouts = [
        {
            "label": lbl,
            "env": "a",
            "example_id": i,
            "reward": r,
            "prompt": [{"role": "user", "content": "q"}],
            "completion_text": f"answer {lbl} {r}",
            "error": err,
        }
        for lbl, i, r, err in [
            ("base", 0, 0.0, None),
            ("base", 1, 1.0, None),
            ("base", 2, 9.0, "boom"),
            ("step_5", 0, 0.5, None),
        ]
    ]
    (run / "eval" / "rollouts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rollouts))
    page = write_report([run]).read_text().split("<script")[0]  # the page, not plotly.js
    assert "<figcaption>eval reward by weights step (eval)</figcaption>" in page
    assert re.findall(r"<h3>(.*?)</h3>", page) == [
        "eval base, best: reward 1.000 (a, example 1)",
        "eval base, worst: reward 0.000 (a, example 0)",
        "eval step_5, best: reward 0.500 (a, example 0)",
        "eval step_5, worst: reward 0.500 (a, example 0)",
    ]
    assert "[user] q" in page and "answer base 1.0" in page and "9.0" not in page  # a failed rollout is no sample
