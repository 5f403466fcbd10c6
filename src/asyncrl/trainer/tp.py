"""Tensor parallelism of a dense HF decoder: each layer's attention heads and MLP columns split over the "tp" ranks.

One job: check that a model can be split `tp` ways and split it with DTensor's parallel styles (Megatron
style): q/k/v and gate/up projections by output columns (ColwiseParallel), o and down projections by input
rows (RowwiseParallel), so each rank computes heads/tp attention heads and intermediate/tp MLP columns and
the row-wise projection sums the partial outputs. Per-head norms (Qwen3's q_norm/k_norm) apply one weight to
the heads each rank holds: they are replicated DTensors over inputs split on the heads dimension, so their
gradient is summed over the tp ranks (DTensor's SequenceParallel style, with heads as the sharded dim).
Everything else (embeddings, norms, lm_head) stays whole on
every tp rank; FSDP2 then shards all of it over the "dp" dimension (`model.shard_model`).

Invariants: the decoder layers' inputs and outputs are ordinary full tensors, the same on every rank of a tp
group, so the loss (`trainer.head`) runs unchanged; the attention reshapes its projections with -1 heads
(transformers' Qwen3, Llama, ...) and so reads the local head count; q and k/v heads split alike, so the
grouping of q heads per kv head is kept. Runs before activation checkpointing wraps the layers.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from asyncrl.core.errors import UserError
from asyncrl.transport.routes import routers

COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROWWISE = ("self_attn.o_proj", "mlp.down_proj")
HEAD_NORMS = ("self_attn.q_norm", "self_attn.k_norm")  # Qwen3: RMSNorm over each head's [.., heads, head_dim]
HEADS_DIM = 2  # of the [batch, seq, heads, head_dim] view the head norms see


def layer_plan(layer: nn.Module) -> dict[str, ParallelStyle]:
    """The parallel style of each projection of a decoder layer (names as in transformers' dense decoders)."""
    plan: dict[str, ParallelStyle] = {}
    for names, style in ((COLWISE, ColwiseParallel), (ROWWISE, RowwiseParallel)):
        for name in names:
            module = _find(layer, name)
            if not isinstance(module, nn.Linear):
                raise UserError(
                    f"model.tp: decoder layer {type(layer).__name__} has no linear '{name}' to split; "
                    "set --model.tp 1 for this model"
                )
            plan[name] = style()
    for name in HEAD_NORMS:  # one weight for every head, each rank sees its own heads: its grad sums over tp
        if _find(layer, name) is not None:
            plan[name] = SequenceParallel(sequence_dim=HEADS_DIM, use_local_output=True)
    return plan


def _find(layer: nn.Module, name: str) -> nn.Module | None:
    try:
        return layer.get_submodule(name)
    except AttributeError:
        return None


def check_tp(model: nn.Module, tp: int) -> None:
    """A one-line user error unless `tp` splits the model: dense, and tp divides heads, kv-heads and MLP width."""
    config = model.config
    if routers(model) or getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None):
        raise UserError(f"model.tp = {tp}: tensor parallelism is built for dense models only; set --model.tp 1")
    sizes = {
        "attention heads (num_attention_heads)": config.num_attention_heads,
        "kv-heads (num_key_value_heads)": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        "MLP width (intermediate_size)": config.intermediate_size,
    }
    for what, n in sizes.items():
        if n % tp:
            raise UserError(f"model.tp = {tp} does not divide the model's {n} {what}: use a --model.tp that does")


def apply_tp(model: nn.Module, layers: nn.ModuleList, mesh: DeviceMesh) -> None:
    """Split every decoder layer of `model` over the 1-D `mesh` (the "tp" dimension)."""
    check_tp(model, mesh.size())
    for layer in layers:
        parallelize_module(layer, mesh, layer_plan(layer))
