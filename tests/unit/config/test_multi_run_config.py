"""`[[runs]]` in an rl config: what each run's orchestrator and run.toml get, and the one-line refusals."""

from __future__ import annotations

import pytest

from asyncrl.config.rl import resolve_rl
from asyncrl.core.errors import UserError
from asyncrl.launcher.supervisor import vllm_lora_flags
from asyncrl.transport.layout import RunLayout

BASE = {
    "model": {"name": "m"},
    "max_steps": 10,
    "output_dir": "/tmp/x",
    "trainer": {"model": {"lora": {"rank": 8}}, "optim": {"lr": 1e-4}},
    "orchestrator": {"batch_size": 16, "rollouts_per_example": 4, "sampling": {"max_tokens": 7}},
}


def rl(runs, **top):
    return resolve_rl({**BASE, **top, "runs": runs})


def test_each_run_gets_the_shared_settings_with_its_own_over_them():
    cfg = rl(
        [
            {"name": "a", "orchestrator": {"env": [{"id": "reverse-text"}]}},
            {"name": "b", "lr": 3e-3, "max_steps": 4, "orchestrator": {"env": [{"id": "echo-twice"}], "batch_size": 8}},
        ]
    )
    orch = cfg.run_orchestrators()
    assert orch["a"].output_dir == RunLayout("/tmp/x").run_dir("a") and orch["a"].lora_name == "a"
    assert orch["a"].sampling.max_tokens == 7 and orch["a"].max_steps == 10 and orch["a"].env[0].id == "reverse-text"
    assert orch["b"].batch_size == 8 and orch["b"].max_steps == 4 and orch["b"].env[0].id == "echo-twice"
    assert orch["b"].rollouts_per_example == 4 and orch["b"].model.name == "m"
    assert cfg.runs[0].run_settings() == {}  # the trainer's own settings apply
    assert cfg.runs[1].run_settings() == {"optim": {"lr": 3e-3}, "max_steps": 4}


def test_trainer_settings_of_a_run_keep_only_what_it_sets():
    cfg = rl([{"name": "a", "trainer": {"optim": {"betas1": 0.8}, "loss": {"type": "grpo"}, "seed": 3}}])
    assert cfg.runs[0].run_settings() == {"optim": {"betas1": 0.8}, "loss": {"type": "grpo"}, "seed": 3}


@pytest.mark.parametrize(
    ("runs", "extra", "says"),
    [
        ([], {}, "runs is empty"),
        ([{"name": "a"}, {"name": "a"}], {}, "run names must differ"),
        ([{"name": "a b"}], {}, "use up to 64 letters, digits"),
        ([{"name": "a..b"}], {}, "without '..'"),
        ([{"name": "a", "lr": 1e-3, "trainer": {"optim": {"lr": 2e-3}}}], {}, "sets lr twice"),
        ([{"name": "a", "trainer": {"optim": {"lrr": 1}}}], {}, "lrr"),
        ([{"name": "a"}], {"trainer": {"optim": {"lr": 1e-4}}}, "add [trainer.model.lora]"),
        ([{"name": "a"}], {"orchestrator": {"lora_name": "x"}}, "drop orchestrator.lora_name"),
        ([{"name": "a", "orchestrator": {"batch_size": 0}}], {}, "[[runs]] 'a'"),
        ([{"name": "a", "orchestrator": {"bogus": 1}}], {}, "bogus"),
        ([{"name": "a"}, {"name": "b"}], {"inference": {"max_lora_adapters": 1}}, "--inference.max-lora-adapters"),
    ],
)
def test_bad_runs_are_one_line_errors(runs, extra, says):
    raw = {**BASE, **extra, "runs": runs}
    if "trainer" in extra:
        raw["trainer"] = extra["trainer"]
    if "orchestrator" in extra:
        raw["orchestrator"] = {**BASE["orchestrator"], **extra["orchestrator"]}
    with pytest.raises(UserError, match=None) as err:
        resolve_rl(raw)
    assert says in str(err.value) and "\n" not in str(err.value).strip()


def test_vllm_gets_room_for_every_run():
    assert vllm_lora_flags([], 16, 3) == ["--enable-lora", "--max-lora-rank", "16", "--max-loras", "3"]
    assert vllm_lora_flags(["--max-loras", "8"], 12, 3) == ["--enable-lora", "--max-lora-rank", "16"]
    assert vllm_lora_flags([], 8) == ["--enable-lora", "--max-lora-rank", "8"]


@pytest.mark.parametrize("path", ["examples/multi_run/rl.toml", "examples/multi_run/rl_gpu.toml"])
def test_the_examples_parse(path):
    from asyncrl.config.cli import parse_or_exit
    from asyncrl.config.rl import RLConfig

    cfg = parse_or_exit(RLConfig, "rl", "", ["@", path], resolve=resolve_rl)
    orch = cfg.run_orchestrators()
    assert [r.name for r in cfg.runs] == ["reverse", "echo"] and cfg.trainer.model.lora is not None
    assert [o.env[0].id for o in orch.values()] == ["reverse-text", "echo-twice"]


@pytest.mark.parametrize("name", ["a", "run-1", "A.b_c", "x" * 64, "a..b", ".a", "-a", "a b", "x" * 65, "é", "a/b"])
def test_a_run_name_rl_accepts_is_one_the_server_loads(name):
    """[[runs]] names become adapter names: one `rl` takes must pass the server's /load_lora_adapter rule."""
    from asyncrl.inference.api.training import ADAPTER_NAME
    from asyncrl.transport.layout import RUN_NAME

    if RUN_NAME.match(name):
        assert ADAPTER_NAME.match(name)
