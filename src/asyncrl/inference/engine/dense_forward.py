"""The embedded engine's forward for dense Qwen3 / Qwen2 / Llama models on CPU, without HF's module machinery.

On a small model on CPU much of HF's forward is not arithmetic but its calling convention: each module's
`__call__`, its kwargs, output dataclasses, the attention-interface lookup. `DenseForward.forward` runs the same
operations in the same order straight on the model's own parameters (read from its modules every forward, so
weight swaps and in-place updates are seen at once) and the engine's `SlotKVCache` (its `update`, in whichever
mode the engine set: prefill, extend or decode): a decode step of 64 rows of the tests' tiny model takes 15% less
CPU than HF's forward.

Invariants: the logits are bit for bit those of HF's forward on the same cache (the unit tests compare them, per
architecture); `for_model` accepts only models whose every layer has the structure `forward` computes (else None,
and the engine keeps HF's forward); the engine calls `forward` only for forwards without a LoRA row or a route record,
whose hooks live on HF's modules.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from asyncrl.inference.engine.attention import NAME as GQA_SDPA
from asyncrl.inference.engine.kv_cache import SlotKVCache

ARCHITECTURES = {"qwen3": "Qwen3RMSNorm", "qwen2": "Qwen2RMSNorm", "llama": "LlamaRMSNorm"}  # model_type -> norm


def _rms_norm(x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    """HF's RMSNorm of these models, op for op (float32 statistics, the weight applied in the input's dtype)."""
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * x32.to(dtype)


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's `apply_rotary_pos_emb` for one tensor: x * cos + rotate_half(x) * sin."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _linear(x: torch.Tensor, proj: torch.nn.Linear) -> torch.Tensor:
    return F.linear(x, proj.weight, proj.bias)


class DenseForward:
    """The forward of an accepted model over the engine's cache: `forward(ids, positions, mask, cache)` -> logits."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.body = model.model
        cfg = model.config
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.qk_norm = cfg.model_type == "qwen3"

    @classmethod
    def for_model(cls, model: torch.nn.Module, device: torch.device) -> DenseForward | None:
        """The engine's own forward for `model` where its structure is the one `forward` computes, else None."""
        return cls(model) if device.type == "cpu" and why_not(model) is None else None

    def forward(
        self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: SlotKVCache, last_only: bool
    ) -> torch.Tensor:
        """Logits [b, P, V] (`last_only`: [b, 1, V]) of `ids` [b, P] at `positions` [b, P], writing their keys and
        values into `cache` (set to the forward's mode beforehand), as HF's forward with that cache and `mask` does
        (with `logits_to_keep=1` when `last_only`)."""
        h = F.embedding(ids, self.body.embed_tokens.weight)
        cos, sin = self.body.rotary_emb(h, positions)  # [b, P, D]
        cos, sin = cos[:, None], sin[:, None]  # over the heads
        for i, layer in enumerate(self.body.layers):
            h = h + self._attention(layer.self_attn, _rms_norm(h, layer.input_layernorm), cos, sin, mask, cache, i)
            h = h + self._mlp(layer.mlp, _rms_norm(h, layer.post_attention_layernorm))
        h = _rms_norm(h, self.body.norm)
        return _linear(h[:, -1:] if last_only else h, self.model.lm_head)

    def _attention(self, attn, x, cos, sin, mask, cache: SlotKVCache, layer: int) -> torch.Tensor:
        rows, width, d = x.shape[0], x.shape[1], self.head_dim
        q = _linear(x, attn.q_proj).view(rows, width, self.heads, d)
        k = _linear(x, attn.k_proj).view(rows, width, self.kv_heads, d)
        if self.qk_norm:
            q, k = _rms_norm(q, attn.q_norm), _rms_norm(k, attn.k_norm)
        v = _linear(x, attn.v_proj).view(rows, width, self.kv_heads, d).transpose(1, 2)
        q, k = _rotary(q.transpose(1, 2), cos, sin), _rotary(k.transpose(1, 2), cos, sin)
        keys, values = cache.update(k, v, layer)
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, scale=attn.scaling, enable_gqa=self.kv_heads != self.heads
        )
        return _linear(out.transpose(1, 2).reshape(rows, width, self.heads * d), attn.o_proj)

    @staticmethod
    def _mlp(mlp, x: torch.Tensor) -> torch.Tensor:
        return _linear(F.silu(_linear(x, mlp.gate_proj)) * _linear(x, mlp.up_proj), mlp.down_proj)


def why_not(model: torch.nn.Module) -> str | None:
    """Why `forward` would not compute what `model`'s own forward does (None: it would)."""
    cfg = model.config
    norm = ARCHITECTURES.get(cfg.model_type)
    if norm is None:
        return f"model type {cfg.model_type!r} (the engine's own forward knows {sorted(ARCHITECTURES)})"
    if cfg._attn_implementation != GQA_SDPA:
        return f"attention {cfg._attn_implementation!r}"
    if getattr(cfg, "hidden_act", None) != "silu" or getattr(cfg, "pretraining_tp", 1) != 1:
        return "an activation or tensor-parallel layout of its own"
    if set(getattr(cfg, "layer_types", None) or ["full_attention"]) != {"full_attention"}:
        return "sliding-window layers"
    if getattr(cfg, "use_sliding_window", False):
        return "a sliding window"
    body = getattr(model, "model", None)
    if body is None or not hasattr(model, "lm_head") or not hasattr(body, "rotary_emb"):
        return "no model.model / lm_head / rotary_emb"
    for layer in body.layers:
        names = {type(m).__name__ for m in (layer.input_layernorm, layer.post_attention_layernorm)}
        if names != {norm} or not all(hasattr(layer.mlp, p) for p in ("gate_proj", "up_proj", "down_proj")):
            return f"a layer of another structure ({type(layer).__name__})"
        if type(layer.mlp.gate_proj) is not torch.nn.Linear or type(layer.self_attn.q_proj) is not torch.nn.Linear:
            return "projections that are not plain nn.Linear"
    return None
