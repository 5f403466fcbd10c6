"""Mixture-of-experts weights in their two spellings, and the conversion between them.

A Hugging Face checkpoint of a Qwen2/Qwen3-MoE holds one tensor per expert and projection
(`...mlp.experts.{i}.gate_proj.weight` [I, H], `up_proj` [I, H], `down_proj` [H, I]); transformers holds them
fused (`...mlp.experts.gate_up_proj` [E, 2I, H], gates first, and `...mlp.experts.down_proj` [E, H, I]). The
trainer publishes the checkpoint spelling (what vLLM and every HF loader read); the embedded engine fuses what
it reads. Other MoE spellings (Mixtral's `w1`/`w2`/`w3`) pass through unchanged.

Invariants: `split(fuse(t)) == t` for a complete set of experts; a set with an expert or projection missing is
left unfused (the reader then names what does not match); a dense model's tensors pass through both unchanged.
"""

from __future__ import annotations

import re
from collections import defaultdict

import torch

_PER_EXPERT = re.compile(r"^(?P<pre>.+\.experts)\.(?P<i>\d+)\.(?P<proj>gate|up|down)_proj\.weight$")
_FUSED = re.compile(r"^(?P<pre>.+\.experts)\.(?P<proj>gate_up|down)_proj$")


def fuse(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert checkpoint tensors -> transformers' fused parameters (others unchanged)."""
    out, groups = {}, defaultdict(dict)
    for key, value in tensors.items():
        m = _PER_EXPERT.match(key)
        if m is None:
            out[key] = value
        else:
            groups[m["pre"]][m["proj"], int(m["i"])] = (key, value)
    for pre, parts in groups.items():
        n = 1 + max(i for _, i in parts)
        if len(parts) != 3 * n:  # incomplete: left as it is, for the reader to name
            out.update(dict(parts.values()))
            continue
        stacked = {proj: torch.stack([parts[proj, i][1] for i in range(n)]) for proj in ("gate", "up", "down")}
        out[f"{pre}.gate_up_proj"] = torch.cat([stacked["gate"], stacked["up"]], dim=1)
        out[f"{pre}.down_proj"] = stacked["down"]
    return out


def split(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Transformers' fused expert parameters -> one tensor per expert and projection (views; others unchanged)."""
    out = {}
    for key, value in tensors.items():
        m = _FUSED.match(key)
        if m is None:
            out[key] = value
        elif m["proj"] == "down":
            out.update({f"{m['pre']}.{i}.down_proj.weight": value[i] for i in range(value.shape[0])})
        else:
            half = value.shape[1] // 2
            for i in range(value.shape[0]):
                out[f"{m['pre']}.{i}.gate_proj.weight"] = value[i, :half]
                out[f"{m['pre']}.{i}.up_proj.weight"] = value[i, half:]
    return out
