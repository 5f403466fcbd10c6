"""The embedded engine's attention on CPU: torch's sdpa reading grouped KV heads in place.

The engine always hands the model a mask, and with a mask HF's sdpa path on CPU repeats every KV head
for the query heads that share it (`repeat_kv`): a copy of all keys and values per layer per forward,
the largest cost of a decode step after the matmuls. torch's CPU sdpa takes grouped heads itself
(`enable_gqa`) with a mask, with bit-identical output. Invariants: same inputs, same output as HF's
"sdpa" (the unit tests compare them); CUDA keeps HF's own path (its fused kernels take no mask with
grouped heads); models that pass anything this function does not handle (position biases) go to HF's.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

NAME = "asyncrl_gqa_sdpa"


def gqa_sdpa_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """HF attention-interface function: [B, H, Q, D] queries over [B, H_kv, L, D] keys -> [B, Q, H, D]."""
    if kwargs.get("position_bias") is not None or kwargs.get("cache") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    causal = attention_mask is None and query.shape[2] > 1 and getattr(module, "is_causal", True)
    out = torch.nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        is_causal=causal,
        enable_gqa=key.shape[1] != query.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


def use_gqa_sdpa(model, device: torch.device) -> bool:
    """Switch a CPU model loaded with "sdpa" to `gqa_sdpa_forward` (True when it did)."""
    if device.type != "cpu" or model.config._attn_implementation != "sdpa":
        return False
    AttentionInterface.register(NAME, gqa_sdpa_forward)
    model.set_attn_implementation(NAME)
    return model.config._attn_implementation == NAME
