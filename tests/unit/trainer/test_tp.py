"""Tensor parallelism's checks: a model that `model.tp` cannot split, or a tp that does not divide the ranks, is
one line naming the fix; the plan splits each projection of a real HF decoder layer the Megatron way."""

import pytest
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from asyncrl.config.trainer import TrainerModelConfig
from asyncrl.core.errors import UserError
from asyncrl.trainer.dist import check_divides
from asyncrl.trainer.tp import check_tp as check_model_tp
from asyncrl.trainer.tp import layer_plan


def qwen3(**overrides):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    size = {"hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 1, "vocab_size": 32, "head_dim": 8}
    return Qwen3ForCausalLM(Qwen3Config(**{**size, "num_attention_heads": 6, "num_key_value_heads": 3, **overrides}))


def test_tp_must_divide_heads_kv_heads_and_mlp_width():
    check_model_tp(qwen3(), 3)
    with pytest.raises(UserError, match=r"does not divide the model's 3 kv-heads .*use a --model.tp that does"):
        check_model_tp(qwen3(), 2)
    with pytest.raises(UserError, match="does not divide the model's 6 attention heads"):
        check_model_tp(qwen3(num_key_value_heads=6), 4)
    with pytest.raises(UserError, match="does not divide the model's 92 MLP width"):
        check_model_tp(qwen3(intermediate_size=92), 3)


def test_tp_on_a_mixture_of_experts_is_refused():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=1, vocab_size=32,
        num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    with pytest.raises(UserError, match="dense models only; set --model.tp 1"):
        check_model_tp(Qwen3MoeForCausalLM(cfg), 2)


def test_tp_must_divide_the_ranks():
    check_divides("tp", 2, 4)
    with pytest.raises(UserError, match=r"model.tp = 2 does not divide the 3 trainer rank\(s\)"):
        check_divides("tp", 2, 3)


def test_the_plan_splits_attention_and_mlp():
    plan = layer_plan(qwen3().model.layers[0])
    colwise = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"}
    assert {k for k, v in plan.items() if isinstance(v, ColwiseParallel)} == colwise
    assert {k for k, v in plan.items() if isinstance(v, RowwiseParallel)} == {"self_attn.o_proj", "mlp.down_proj"}
    assert {k for k, v in plan.items() if isinstance(v, SequenceParallel)} == {"self_attn.q_norm", "self_attn.k_norm"}


def test_tp_config_values():
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        TrainerModelConfig(name="m", tp=0)
    with pytest.raises(ValueError, match="not built for LoRA yet: drop --model.lora or set --model.tp 1"):
        TrainerModelConfig(name="m", tp=2, lora={"rank": 4})
