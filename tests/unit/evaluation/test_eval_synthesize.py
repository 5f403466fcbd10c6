"""eval/synthesize logic without a server: targets, table, sampling args, errors, synthesize's resume rules.

Rollouts are replaced at the `run_group` boundary here; tests/integration/test_{eval,synthesize}.py run
them for real against our server.
"""

import asyncio
import importlib
import json
import tomllib
from pathlib import Path

import pytest

from asyncrl.config.eval import EvalConfig
from asyncrl.config.orchestrator import SamplingConfig
from asyncrl.config.synthesize import SynthesizeConfig
from asyncrl.core.errors import UserError
from asyncrl.evaluation import synthesize as synth
from asyncrl.evaluation.evaluate import find_targets, format_table
from asyncrl.evaluation.runner import RolloutRecord, check_server, request_args, summarize
from asyncrl.orchestrator.envs.mixture import example_id
from asyncrl.orchestrator.envs.runners import Runners
from asyncrl.transport.layout import RunLayout


def _synthesize(config: SynthesizeConfig) -> synth.SynthStats:
    return synth.run_synthesize(config, RunLayout.for_config(config))


def _weights(tmp_path, steps, stable=True):
    root = tmp_path / "weights"
    for s in steps:
        d = root / f"step_{s}"
        d.mkdir(parents=True)
        (d / ("STABLE" if stable else "model.safetensors")).write_text("")
    (root / ".tmp_step_99_abc").mkdir(parents=True)  # a half-written dir is never a target
    return root


def test_targets_base_and_steps(tmp_path):
    root = _weights(tmp_path, [10, 2, 50])
    cfg = EvalConfig(environment_ids=["x"], weights_dir=root)
    assert [t.label for t in find_targets(cfg)] == ["base", "step_2", "step_10", "step_50"]
    cfg = EvalConfig(environment_ids=["x"], weights_dir=root, steps=[50, 10], eval_base=False)
    assert [(t.label, t.path.name) for t in find_targets(cfg)] == [("step_50", "step_50"), ("step_10", "step_10")]
    assert [t.label for t in find_targets(EvalConfig(environment_ids=["x"]))] == ["model"]


def test_target_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        find_targets(EvalConfig(environment_ids=["x"], weights_dir=tmp_path / "missing"))
    (tmp_path / "empty" / "step_3").mkdir(parents=True)  # no weights in it
    with pytest.raises(UserError, match="no step_N weight dirs"):
        find_targets(EvalConfig(environment_ids=["x"], weights_dir=tmp_path / "empty"))
    root = _weights(tmp_path, [10], stable=False)
    with pytest.raises(UserError, match=r"step\(s\) \[20\] not found.*available steps: \[10\]"):
        find_targets(EvalConfig(environment_ids=["x"], weights_dir=root, steps=[10, 20]))


def _rec(env, reward, error=None, **metrics):
    return RolloutRecord(env=env, example_id=0, rollout=0, reward=reward, metrics=metrics, error=error)


def test_summary_counts_failures_as_zero_and_table_lists_steps():
    per = summarize([_rec("a", 1.0, m=1.0), _rec("a", 0.5, m=0.0), _rec("a", 0.9, error="Empty"), _rec("b", 0.2)])
    assert per["a"]["reward_mean"] == pytest.approx(0.5) and per["a"]["errors"] == 1
    assert per["a"]["metrics"] == {"m": 0.5} and per["b"]["rollouts"] == 1
    table = format_table({"base": per, "step_10": summarize([_rec("a", 1.0, m=1.0)])}).splitlines()
    assert table[0].split() == ["step", "|", "a", "|", "b"]
    assert table[2].startswith("base") and "0.500 ± 0.408" in table[2] and "0.200 ± 0.000" in table[2]
    assert table[3].startswith("step_10") and table[3].rstrip().endswith("-")  # env b not evaluated there
    assert any(line.startswith("base    | a") and "m 0.500" in line for line in table)


def test_request_args_drop_vllm_only_defaults():
    args = request_args(SamplingConfig(temperature=0.7, max_tokens=5, seed=3))
    assert args == {"n": 1, "temperature": 0.7, "top_p": 1.0, "max_tokens": 5, "seed": 3}
    assert request_args(SamplingConfig(top_k=20))["extra_body"] == {"top_k": 20}


def test_unreachable_server_names_url_and_how_to_start():
    from asyncrl.config.orchestrator import ClientConfig

    with pytest.raises(
        UserError, match=r"no OpenAI-compatible server reachable at http://127.0.0.1:9/v1.*inference --model.name"
    ):
        asyncio.run(check_server(ClientConfig(base_url="http://127.0.0.1:9/v1"), "m", wait=0))


def test_eval_cli_missing_env_is_one_line(tmp_path, capsys):
    from asyncrl.entrypoints.eval import main

    with pytest.raises(SystemExit) as e:
        main(["--environment-ids", "no-such-env", "--output-dir", str(tmp_path), "--log.level", "error"])
    assert e.value.code == 2
    assert (
        capsys.readouterr().err.strip().splitlines()[-1].startswith("error: environment 'no-such-env' is not installed")
    )


def test_evals_is_the_eval_command(capsys):
    # `evals`: the shell builtin `eval` shadows the console script `eval` in some shells
    scripts = tomllib.loads((Path(__file__).resolve().parents[3] / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["evals"] == scripts["eval"] == "asyncrl.entrypoints.eval:main"
    module, _, name = scripts["evals"].partition(":")
    with pytest.raises(SystemExit) as e:
        getattr(importlib.import_module(module), name)(["--help"])
    assert e.value.code == 0 and "--environment-ids" in capsys.readouterr().out


# ---- synthesize: resume bookkeeping ---------------------------------------------------------------


class FakeRollouts:
    """Stands in for verifiers' run_group: answers per example, optionally failing like a dead server."""

    def __init__(self, fail_examples=(), empty_examples=()):
        self.calls = []
        self.fail, self.empty = set(fail_examples), set(empty_examples)

    async def __call__(self, slot, inputs, args):
        ex = example_id(inputs[0])
        self.calls.append((slot.name, ex, len(inputs)))
        if ex in self.fail:
            raise ConnectionError("server went away")
        out = []
        for i, row in enumerate(inputs):
            error = {"error": "EmptyModelResponseError", "message": "empty"} if ex in self.empty else None
            out.append(
                {
                    "example_id": ex,
                    "prompt": [{"role": "user", "content": row.data.prompt}],
                    "reward": 0.25 * (i + 1),
                    "metrics": {},
                    "completion": [{"role": "assistant", "content": row.data.answer}],
                    "error": error,
                }
            )
        return out


@pytest.fixture
def fake_synth(monkeypatch):
    fake = FakeRollouts()

    async def no_server(*args, **kwargs):
        return None

    monkeypatch.setattr(synth, "check_server", no_server)
    monkeypatch.setattr(synth, "make_runners", lambda client, model, slots, log_dir=None: Runners(fake))
    return fake


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_synthesize_appends_only_missing(fake_synth, tmp_path):
    cfg = lambda n, r, **kw: SynthesizeConfig(  # noqa: E731
        environment_ids=["reverse-text"],
        num_examples=n,
        rollouts_per_example=r,
        output_dir=tmp_path,
        **kw,
    )
    data = tmp_path / "synthetic" / "data.jsonl"
    _synthesize(cfg(3, 2))
    rows = _lines(data)
    assert [(r["example_id"], r["rollout"]) for r in rows if r["example_id"] == 0] == [(0, 0), (0, 1)]
    assert len(rows) == 6 and rows[0]["completion"][0]["role"] == "assistant"
    fake_synth.calls.clear()
    _synthesize(cfg(3, 2))
    assert fake_synth.calls == [] and _lines(data) == rows
    _synthesize(cfg(4, 3))
    assert sorted(fake_synth.calls) == [
        ("reverse-text", 0, 1),
        ("reverse-text", 1, 1),
        ("reverse-text", 2, 1),
        ("reverse-text", 3, 3),
    ]
    grown = _lines(data)
    assert grown[:6] == rows and len(grown) == 12
    assert len({(r["example_id"], r["rollout"]) for r in grown}) == 12


def test_synthesize_min_reward_model_errors_and_retries(fake_synth, tmp_path):
    fake_synth.fail, fake_synth.empty = {1}, {2}
    cfg = SynthesizeConfig(
        environment_ids=["reverse-text"], num_examples=3, rollouts_per_example=2, min_reward=0.5, output_dir=tmp_path
    )
    _synthesize(cfg)
    data = tmp_path / "synthetic" / "data.jsonl"
    assert [(r["example_id"], r["reward"]) for r in _lines(data)] == [(0, 0.5)]  # 0.25 filtered out
    progress = synth.read_progress(synth.progress_path(data))
    assert progress == {("reverse-text", 0): 2, ("reverse-text", 2): 2}  # empty answers ran; example 1 did not
    fake_synth.fail, fake_synth.calls = set(), []
    _synthesize(cfg)
    assert fake_synth.calls == [("reverse-text", 1, 2)]  # only the group the server failed is retried


def test_all_groups_failing_is_an_error(fake_synth, tmp_path):
    fake_synth.fail = {0, 1}
    cfg = SynthesizeConfig(
        environment_ids=["reverse-text"],
        num_examples=2,
        output_dir=tmp_path,
        client={"base_url": "http://127.0.0.1:9/v1"},
    )
    with pytest.raises(UserError, match="every rollout group failed.*server went away.*127.0.0.1:9"):
        _synthesize(cfg)


def test_repair_drops_rows_beyond_progress_and_torn_lines(tmp_path):
    data = tmp_path / "data.jsonl"
    good = {"env": "e", "example_id": 0, "rollout": 0, "prompt": [], "completion": []}
    orphan = dict(good, example_id=1)  # written, but the crash came before its progress line
    data.write_text(json.dumps(good) + "\n" + json.dumps(orphan) + "\n" + '{"env": "e", "exa')
    progress = synth.progress_path(data)
    progress.write_text(json.dumps({"env": "e", "example_id": 0, "rollouts": 1}) + '\n{"env"')
    done = synth.read_progress(progress)
    assert done == {("e", 0): 1}
    assert synth.repair_dataset(data, done) == 1 and _lines(data) == [good]


def test_sft_row_converts_tools_and_tool_calls():
    record = RolloutRecord(
        env="tool-calc",
        example_id=3,
        rollout=1,
        reward=1.0,
        prompt=[{"role": "user", "content": "1+1?"}],
        completion=[
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [json.dumps({"id": "c", "name": "calculate", "arguments": '{"expression": "1+1"}'})],
            },
            {"role": "tool", "content": "2", "tool_call_id": "c"},
            {"role": "assistant", "content": "2"},
        ],
        tools=[{"name": "calculate", "description": "d", "parameters": {"type": "object"}}],  # the flat form
    )
    row = synth.sft_row(record)
    assert row["tools"] == [
        {"type": "function", "function": {"name": "calculate", "description": "d", "parameters": {"type": "object"}}}
    ]
    call = row["completion"][0]["tool_calls"][0]
    assert call["function"] == {"name": "calculate", "arguments": '{"expression": "1+1"}'} and call["id"] == "c"
    assert (row["env"], row["example_id"], row["rollout"], row["reward"]) == ("tool-calc", 3, 1, 1.0)
