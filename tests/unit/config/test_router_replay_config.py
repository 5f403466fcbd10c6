"""`[trainer.model] router_replay`: rl turns on the server's routing record, and refuses what cannot replay."""

from __future__ import annotations

import json

import pytest

from asyncrl.config import loader
from asyncrl.config.inference import InferenceConfig
from asyncrl.config.rl import RLConfig, resolve_rl
from asyncrl.core.errors import UserError


def model_dir(tmp_path, **config) -> str:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def rl(*argv: str) -> RLConfig:
    raw, args = loader.collect_raw(RLConfig, list(argv), {})
    return resolve_rl(raw, args)


def test_replay_turns_on_the_embedded_engines_routing_record(tmp_path):
    moe = model_dir(tmp_path, num_experts=8, num_experts_per_tok=2)
    config = rl("--model.name", moe, "--inference.backend", "embedded", "--trainer.model.router-replay")
    assert config.trainer.model.router_replay and config.inference.enable_return_routed_experts
    plain = rl("--model.name", moe, "--inference.backend", "embedded")
    assert not plain.trainer.model.router_replay and not plain.inference.enable_return_routed_experts


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--model.name", "{dense}"], "is not a mixture of experts \\(its config.json names no experts\\)"),
        (["--model.name", "{moe}", "--inference.backend", "vllm"], "needs the embedded engine: vLLM .* not wired"),
        (
            [
                "--model.name",
                "{moe}",
                "--inference.backend",
                "embedded",
                "--inference.enable-return-routed-experts",
                "false",
            ],
            "needs the routes the server records",
        ),
    ],
)
def test_what_cannot_replay_is_a_one_line_config_error(tmp_path, argv, said):
    (tmp_path / "dense").mkdir()
    (tmp_path / "moe").mkdir()
    dirs = {"dense": model_dir(tmp_path / "dense", hidden_size=8), "moe": model_dir(tmp_path / "moe", num_experts=8)}
    with pytest.raises(UserError, match=said) as e:
        rl(*[a.format(**dirs) for a in argv], "--trainer.model.router-replay")
    assert "\n" not in str(e.value)


def test_the_vllm_server_refuses_to_record_routes():
    with pytest.raises(ValueError, match="serve with --backend embedded"):
        InferenceConfig(backend="vllm", enable_return_routed_experts=True)


def test_replay_with_multi_run_training_is_a_config_error():
    from asyncrl.config.trainer import TrainerConfig

    with pytest.raises(ValueError, match="router_replay is not built for multi-run training yet"):
        TrainerConfig(max_concurrent_runs=2, model={"lora": {}, "router_replay": True})
