"""The tiny mixture-of-experts model (`asyncrl-tiny-model --experts N`) and the trainer's router-load metrics
(`trainer/moe.py`), on a model built here."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncrl.trainer.moe import RouterLoad, log_part, routers
from asyncrl.utils.tiny_model import build_tiny_model, main


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("moe"), hidden_size=64, num_layers=2, experts=8)


def test_the_tiny_moe_routes_each_token_to_its_top_k_of_8_experts(moe_dir):
    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    assert type(model).__name__ == "Qwen3MoeForCausalLM" and model.config.num_experts == 8
    load = RouterLoad(model)
    assert len(load.routers) == 2
    model(torch.randint(0, 255, (3, 20)))
    assert load.counts.sum(dim=1).tolist() == [3 * 20 * 2] * 2  # every token, top-2, in each layer
    metrics = load.take(lambda t: t.double())
    assert metrics["moe/load_max_over_mean"] >= 1.0 >= metrics["moe/load_min_over_mean"] >= 0.0
    assert load.take(lambda t: t.double()) == {}  # taken: counts start over; a step without tokens has none


def test_load_metrics_say_how_uneven_the_experts_were():
    load = RouterLoad(torch.nn.Linear(1, 1))  # no routers: a dense model
    assert load.routers == [] and load.take(lambda t: t) == {}
    load.routers, load.counts = [None, None], torch.tensor([[4.0, 4.0, 4.0, 4.0], [16.0, 0.0, 0.0, 0.0]])
    m = load.take(lambda t: t)
    assert m == {
        "moe/load_max_over_mean": (1.0 + 4.0) / 2,
        "moe/load_min_over_mean": 0.5,
        "moe/experts_idle_frac": 3 / 8,
    }
    assert log_part(m) == " | moe load max/mean 2.50" and log_part({"loss": 1.0}) == ""


def test_a_dense_tiny_model_has_no_routers(tiny_model_dir):
    assert routers(AutoModelForCausalLM.from_pretrained(tiny_model_dir)) == []


def test_a_top_k_above_the_experts_is_a_one_line_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path / "m"), "--experts", "2", "--experts-per-token", "3"])
    assert (
        e.value.code == 2 and "--experts-per-token (3) must be between 1 and --experts (2)" in capsys.readouterr().err
    )
    assert not (tmp_path / "m").exists()


def test_expert_tensors_convert_exactly_as_transformers_saves_and_loads_them(moe_dir):
    """`transport.experts`: the checkpoint's per-expert tensors (as transformers' save_pretrained wrote them) and
    the model's fused parameters (as its from_pretrained made them) are each other's conversion, bit for bit."""
    from safetensors.torch import load_file

    from asyncrl.transport import experts

    saved = load_file(moe_dir / "model.safetensors")
    held = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).state_dict()
    assert "model.layers.0.mlp.experts.7.up_proj.weight" in saved and "model.layers.0.mlp.experts.gate_up_proj" in held
    fused = experts.fuse(saved)
    assert set(fused) == set(held) - {"lm_head.weight"}  # tied
    assert all(torch.equal(fused[k], held[k]) for k in fused)
    back = experts.split({k: held[k] for k in fused})
    assert set(back) == set(saved) and all(torch.equal(back[k], saved[k]) for k in saved)
    partial = {k: v for k, v in saved.items() if k != "model.layers.1.mlp.experts.3.down_proj.weight"}
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in experts.fuse(partial)  # incomplete: left unfused
    dense = {"model.layers.0.mlp.down_proj.weight": torch.zeros(2, 2)}
    assert experts.fuse(dense) == dense and experts.split(dense) == dense


def test_a_negative_expert_count_is_a_one_line_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path / "m"), "--experts", "-1"])
    assert e.value.code == 2 and "--experts (-1) must be 0 (a dense model) or more" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()
