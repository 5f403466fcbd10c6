"""LoRA: low-rank adapters on chosen linear layers (base frozen) and merging them back for export.

`LoRALinear` keeps the original layer as `.base` and adds `lora_A` (rank x in, random) and `lora_B`
(out x rank, zeros, so a fresh adapter changes nothing): y = base(x) + scale * B(A(dropout(x))) with
scale = alpha / rank. `merge_lora_state_dict` folds B @ A * scale into the base weight and restores
the original key names, so the inference server receives a plain HF checkpoint. `peft_adapter` gives the
same adapter in PEFT's format (`adapter_config.json` + `adapter_model.safetensors`, keys
`base_model.model.<module>.lora_A.weight`), which `peft`, vLLM and our engine load on the base model.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from asyncrl.utils.errors import UserError

_BASE = ".base."
_A = ".lora_A.weight"
_B = ".lora_B.weight"


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float) -> None:
        super().__init__()
        self.base = base
        self.rank = rank
        self.scale = alpha / rank
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, dtype=base.weight.dtype, device=base.weight.device)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, dtype=base.weight.dtype, device=base.weight.device)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_B(self.lora_A(self.dropout(x))) * self.scale


def apply_lora(model: nn.Module, rank: int, alpha: float, dropout: float, target_modules: list[str]) -> int:
    """Wrap every nn.Linear whose attribute name is in `target_modules`; freeze everything else.

    Returns the number of wrapped layers (0 is a user error: the names match nothing).
    """
    targets = set(target_modules)
    found = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if name in targets and isinstance(child, nn.Linear):
                found.append((parent, name, child))
    if not found:
        linear_names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise UserError(
            f"model.lora.target_modules {sorted(targets)} match no linear layer; this model has {linear_names}"
        )
    for p in model.parameters():
        p.requires_grad_(False)
    for parent, name, child in found:
        setattr(parent, name, LoRALinear(child, rank, alpha, dropout))
    return len(found)


def merge_lora_state_dict(state: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """Full state dict with LoRA keys -> plain HF keys with W + scale * B @ A folded in."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key.endswith(_A) or key.endswith(_B):
            continue
        if _BASE in key:
            prefix, leaf = key.split(_BASE, 1)
            plain = f"{prefix}.{leaf}"
            if leaf == "weight":
                a, b = state[prefix + _A], state[prefix + _B]
                value = (value.float() + scale * (b.float() @ a.float())).to(value.dtype)
            out[plain] = value
        else:
            out[key] = value
    return out


PEFT_PREFIX = "base_model.model."


def peft_adapter(
    state: dict[str, torch.Tensor], rank: int, alpha: float, dropout: float, base_model: str
) -> tuple[dict, dict[str, torch.Tensor]]:
    """Full state dict with LoRA keys -> (adapter_config.json contents, PEFT-named adapter tensors)."""
    tensors = {PEFT_PREFIX + k: v.contiguous() for k, v in state.items() if k.endswith(_A) or k.endswith(_B)}
    modules = sorted({k.removesuffix(_A).rsplit(".", 1)[-1] for k in state if k.endswith(_A)})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
    }
    return config, tensors
