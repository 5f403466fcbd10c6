"""Learning-rate schedules and LoRA wrapping/merging."""

import math

import pytest
import torch
from torch import nn

from asyncrl.config.trainer import OptimConfig, SchedulerConfig
from asyncrl.core.errors import UserError
from asyncrl.trainer.lora import LoRALinear, apply_lora, merge_lora_state_dict
from asyncrl.trainer.optim import apply_gradients, build_optimizer, build_scheduler, lr_factor


def test_constant_with_warmup():
    cfg = SchedulerConfig(type="constant", warmup_steps=4)
    assert [lr_factor(s, cfg, 1.0, None) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_linear_and_cosine_decay_to_min_lr():
    lin = SchedulerConfig(type="linear", warmup_steps=2, min_lr=0.1)
    assert lr_factor(2, lin, 1.0, 12) == pytest.approx(1.0)
    assert lr_factor(7, lin, 1.0, 12) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(12, lin, 1.0, 12) == pytest.approx(0.1)
    cos = SchedulerConfig(type="cosine", decay_steps=4)
    assert [lr_factor(s, cos, 1.0, None) for s in (0, 2, 4, 9)] == pytest.approx([1.0, 0.5, 0.0, 0.0])
    assert lr_factor(1, cos, 1.0, None) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))


def test_decay_needs_a_horizon():
    with pytest.raises(UserError, match="decay_steps or max_steps"):
        lr_factor(0, SchedulerConfig(type="cosine"), 1.0, None)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(8, 8)
        self.mlp = nn.Linear(8, 8)

    def forward(self, x):
        return self.mlp(self.q_proj(x))


def test_lora_only_adapters_train_and_merge_matches():
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    assert apply_lora(model, rank=2, alpha=4.0, dropout=0.0, target_modules=["q_proj"]) == 2
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable == [
        "0.q_proj.lora_A.weight",
        "0.q_proj.lora_B.weight",
        "1.q_proj.lora_A.weight",
        "1.q_proj.lora_B.weight",
    ]
    for m in model.modules():
        if isinstance(m, LoRALinear):
            nn.init.normal_(m.lora_B.weight)  # a trained adapter
    x = torch.randn(3, 8)
    merged = merge_lora_state_dict(model.state_dict(), scale=2.0)
    assert sorted(merged) == sorted(nn.Sequential(Block(), Block()).state_dict())
    plain = nn.Sequential(Block(), Block())
    plain.load_state_dict(merged)
    assert torch.allclose(plain(x), model(x), atol=1e-5)


def test_lora_unknown_targets():
    with pytest.raises(UserError, match=r"match no linear layer; this model has \['mlp', 'q_proj'\]"):
        apply_lora(Block(), 2, 4.0, 0.0, ["gate"])


def _model_with_grad(grad: float):
    model = nn.Linear(2, 1, bias=False)
    optimizer = build_optimizer(list(model.parameters()), OptimConfig(lr=0.1, weight_decay=0.0))
    scheduler = build_scheduler(optimizer, SchedulerConfig(type="constant"), None)
    model.weight.grad = torch.full_like(model.weight, grad)
    return model, optimizer, scheduler, model.weight.detach().clone()


def test_apply_gradients_clips_steps_and_zeroes():
    model, optimizer, scheduler, before = _model_with_grad(3.0)
    grad_norm, lr = apply_gradients([model.weight], optimizer, scheduler, 1.0, step=7)
    assert grad_norm == pytest.approx(3.0 * math.sqrt(2)) and lr == pytest.approx(0.1)
    assert model.weight.grad is None and not torch.equal(model.weight.detach(), before)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_apply_gradients_refuses_a_non_finite_norm_before_stepping(bad):
    model, optimizer, scheduler, before = _model_with_grad(bad)
    with pytest.raises(UserError, match="gradient norm is .* at step 7; stopped before the optimizer step"):
        apply_gradients([model.weight], optimizer, scheduler, 1.0, step=7)
    assert torch.equal(model.weight.detach(), before)
