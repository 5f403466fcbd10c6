"""LoRA: low-rank adapters on chosen linear layers (base frozen) and merging them back for export.

`LoRALinear` keeps the original layer as `.base` and adds `lora_A` (rank x in, random) and `lora_B`
(out x rank, zeros, so a fresh adapter changes nothing): y = base(x) + scale * B(A(dropout(x))) with
scale = alpha / rank. `merge_lora_state_dict` folds B @ A * scale into the base weight and restores
the original key names, so the inference server receives a plain HF checkpoint. `peft_adapter` gives the
same adapter in PEFT's format (`adapter_config.json` + `adapter_model.safetensors`, keys
`base_model.model.<module>.lora_A.weight`), which `peft`, vLLM and our engine load on the base model.

Multi-run training (`trainer.runs`) uses `MultiLoRALinear` instead: `slots` adapters per layer, allocated
when the model loads (FSDP2 cannot take parameters added after sharding), one `lora_A.<i>` / `lora_B.<i>`
parameter pair per slot so each run's optimizer owns its slot's tensors and nothing else. The shared
`SlotSelector` says which slot every layer applies: one slot for the whole batch, or (a mixed-run forward)
a slot per row, applied as a gathered batched matmul (each row's A and B picked from the round's slots, one
`bmm` per projection), so rows of several runs share one forward of the frozen base. A slot that is not in
the forward gets no gradient (FSDP2 reduces only parameters that have one); in a mixed forward every slot of
the round gets one (zeros where it has no rows), so every rank reduces the same parameters.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn import functional as F

from asyncrl.core.errors import UserError

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
    found = _target_linears(model, target_modules)
    for p in model.parameters():
        p.requires_grad_(False)
    for _, parent, name, child in found:
        setattr(parent, name, LoRALinear(child, rank, alpha, dropout))
    return len(found)


def _target_linears(model: nn.Module, target_modules: list[str]) -> list[tuple[str, nn.Module, str, nn.Linear]]:
    """(module path, parent, attribute, layer) of every nn.Linear named in `target_modules` (none: UserError)."""
    targets = set(target_modules)
    found = [
        (f"{path}.{name}" if path else name, parent, name, child)
        for path, parent in model.named_modules()
        for name, child in parent.named_children()
        if name in targets and isinstance(child, nn.Linear)
    ]
    if not found:
        linear_names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise UserError(
            f"model.lora.target_modules {sorted(targets)} match no linear layer; this model has {linear_names}"
        )
    return found


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


class SlotSelector:
    """The adapter slot(s) every `MultiLoRALinear` of one model applies (one object shared by all layers): row i
    of a stacked [rows, length, ...] batch applies slot `slots[rows[i]]`; with one slot every row applies it
    (outside `mixed`: slot 0)."""

    def __init__(self) -> None:
        self.slots: list[int] = [0]
        self.rows: torch.Tensor | None = None

    @contextmanager
    def mixed(self, slots: list[int], rows: torch.Tensor | None) -> Iterator[None]:
        """Forwards inside apply slot `slots[rows[i]]` to row i (`rows` may be None with a single slot)."""
        self.slots, self.rows = slots, rows
        try:
            yield
        finally:
            self.slots, self.rows = [0], None


class MultiLoRALinear(nn.Module):
    """`slots` independent adapters on one frozen linear layer; the selector's active slot is applied."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float, slots: int, sel: SlotSelector):
        super().__init__()
        self.base, self.rank, self.scale, self._sel = base, rank, alpha / rank, sel
        a_shape, b_shape, dtype = (rank, base.in_features), (base.out_features, rank), base.weight.dtype
        self.lora_A = nn.ParameterList([nn.Parameter(torch.empty(a_shape, dtype=dtype)) for _ in range(slots)])
        self.lora_B = nn.ParameterList([nn.Parameter(torch.zeros(b_shape, dtype=dtype)) for _ in range(slots)])
        for a in self.lora_A:
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sel = self._sel
        if len(sel.slots) == 1:
            i = sel.slots[0]
            return self.base(x) + F.linear(F.linear(self.dropout(x), self.lora_A[i]), self.lora_B[i]) * self.scale
        a = torch.stack([self.lora_A[i] for i in sel.slots])[sel.rows]  # [rows, rank, in]: each row's own A
        b = torch.stack([self.lora_B[i] for i in sel.slots])[sel.rows]  # [rows, out, rank]
        return self.base(x) + torch.bmm(torch.bmm(self.dropout(x), a.mT), b.mT) * self.scale


def apply_multi_lora(
    model: nn.Module, rank: int, alpha: float, dropout: float, target_modules: list[str], slots: int
) -> tuple[SlotSelector, list[dict[str, str]]]:
    """Wrap the target linears with `slots` adapters each; freeze the rest. Returns the selector and, per
    slot, {parameter name: PEFT key} of its tensors (names as the model's state dict has them)."""
    found = _target_linears(model, target_modules)
    for p in model.parameters():
        p.requires_grad_(False)
    sel = SlotSelector()
    names: list[dict[str, str]] = [{} for _ in range(slots)]
    for path, parent, name, child in found:
        setattr(parent, name, MultiLoRALinear(child, rank, alpha, dropout, slots, sel))
        for i in range(slots):
            for ab in ("A", "B"):
                names[i][f"{path}.lora_{ab}.{i}"] = f"{PEFT_PREFIX}{path}.lora_{ab}.weight"
    return sel, names


PEFT_PREFIX = "base_model.model."


def peft_adapter(
    state: dict[str, torch.Tensor], rank: int, alpha: float, dropout: float, base_model: str
) -> tuple[dict, dict[str, torch.Tensor]]:
    """Full state dict with LoRA keys -> (adapter_config.json contents, PEFT-named adapter tensors)."""
    tensors = {PEFT_PREFIX + k: v.contiguous() for k, v in state.items() if k.endswith(_A) or k.endswith(_B)}
    return peft_config(tensors, rank, alpha, dropout, base_model), tensors


def peft_config(tensors: dict[str, torch.Tensor], rank: int, alpha: float, dropout: float, base_model: str) -> dict:
    """adapter_config.json of the PEFT-named adapter `tensors`."""
    modules = sorted({k.removesuffix(_A).rsplit(".", 1)[-1] for k in tensors if k.endswith(_A)})
    return {
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


@contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """Inside, every adapter (single or multi-slot) adds nothing: the model computes its frozen base (the
    reference policy of a LoRA run, with no second copy). Meant for no-grad forwards."""
    layers = [m for m in model.modules() if isinstance(m, (LoRALinear, MultiLoRALinear))]
    scales = [m.scale for m in layers]
    for m in layers:
        m.scale = 0.0
    try:
        yield
    finally:
        for m, scale in zip(layers, scales):
            m.scale = scale
