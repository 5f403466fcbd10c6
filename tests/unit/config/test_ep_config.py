"""`[trainer.model] ep`: what expert parallelism cannot split is a one-line config error, before any process starts."""

from __future__ import annotations

import json

import pytest

from asyncrl.config import loader
from asyncrl.config.rl import RLConfig, resolve_rl
from asyncrl.config.trainer import TrainerModelConfig
from asyncrl.core.errors import UserError


def model_dir(path, **config) -> str:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def rl(*argv: str) -> RLConfig:
    raw, args = loader.collect_raw(RLConfig, list(argv), {})
    return resolve_rl(raw, args)


def test_ep_that_splits_the_experts_is_taken(tmp_path):
    moe = model_dir(tmp_path / "moe", num_experts=8, num_experts_per_tok=2)
    assert rl("--model.name", moe, "--trainer.model.ep", "2").trainer.model.ep == 2


@pytest.mark.parametrize(
    ("model", "ep", "said"),
    [
        ("moe", "3", r"trainer.model.ep = 3 does not divide the model's 8 experts"),
        ("dense", "2", r"trainer.model.ep = 2: .* is not a mixture of experts"),
        ("moe", "0", r"greater than or equal to 1"),
    ],
)
def test_what_ep_cannot_split_is_one_line(tmp_path, model, ep, said):
    dirs = {"moe": model_dir(tmp_path / "moe", num_experts=8), "dense": model_dir(tmp_path / "dense", hidden_size=8)}
    with pytest.raises(UserError, match=said) as e:
        rl("--model.name", dirs[model], "--trainer.model.ep", ep)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("fields", "said"),
    [
        ({"ep": 2, "lora": {}}, "model.ep = 2 is not built for LoRA yet"),
        ({"ep": 2, "tp": 2}, "model.ep and model.tp do not combine yet"),
    ],
)
def test_ep_with_lora_or_tp_is_a_config_error(fields, said):
    with pytest.raises(ValueError, match=said):
        TrainerModelConfig(name="m", **fields)
