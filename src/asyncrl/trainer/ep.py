"""Expert parallelism of a mixture-of-experts HF decoder: each rank holds num_experts / ep of every layer's experts.

One job: check that a model's experts split `ep` ways, split them, and run each MoE layer's experts across the
ranks of an "ep" group. The experts' fused weights (transformers' `gate_up_proj` [E, 2I, H], `down_proj` [E, H, I])
become DTensors sharded on dim 0 over the "ep" dimension of an ("edp", "ep") mesh; FSDP2 then shards them over
"edp" only (`model.shard_model`), while every other parameter (attention, norms, the router) is sharded by FSDP2
over all ranks as usual. A layer's forward: the router runs on every rank over its own tokens (routing replay and
router-load hooks see the whole choice), the (token, expert) pairs are ordered by the rank that owns the expert,
sent there with one autograd-aware `all_to_all_single` (counts first), run through the local experts, sent back
with another, and combined with the gate weights where they came from.

Invariants: every rank gets its own data (the ep ranks are data-parallel for everything but the experts), so a
rank's expert gradient sums the contributions of the tokens of its whole ep group; the experts' FSDP2 unit
divides by the world size (not by "edp") so they get the same per-token mean as the other parameters. A rank
with no token for some expert still joins both exchanges (sizes may be 0). ep == 1 leaves the model unchanged.
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from asyncrl.core.errors import UserError

FUSED = ("gate_up_proj", "down_proj")


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The modules holding a layer's fused expert weights (transformers' `...mlp.experts`), in layer order."""
    return [m for m in model.modules() if all(isinstance(getattr(m, n, None), nn.Parameter) for n in FUSED)]


def check_ep(model: nn.Module, ep: int) -> None:
    """A one-line user error unless `ep` splits the model's experts: an MoE with fused experts, ep dividing them."""
    experts = expert_modules(model)
    if not experts:
        raise UserError(
            f"model.ep = {ep}: expert parallelism needs a mixture-of-experts model with fused experts "
            "(gate_up_proj/down_proj); set --model.ep 1 for this model"
        )
    n = experts[0].gate_up_proj.shape[0]
    if n % ep:
        raise UserError(f"model.ep = {ep} does not divide the model's {n} experts: use a --model.ep that does")


def ep_mesh(device_type: str, world: int, ep: int) -> DeviceMesh:
    """The ("edp", "ep") mesh of shape (world / ep, ep): a row of `ep` neighbouring ranks shares its experts."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (world // ep, ep), mesh_dim_names=("edp", "ep"))


def apply_ep(model: nn.Module, mesh: DeviceMesh) -> list[nn.Module]:
    """Shard every layer's experts over `mesh["ep"]` and route their tokens across it; returns the expert modules
    (each is to be its own FSDP2 unit over `mesh["edp"]`)."""
    ep = mesh["ep"]
    check_ep(model, ep.size())
    experts = expert_modules(model)
    for module in experts:
        for name in FUSED:
            weight = getattr(module, name)
            sharded = distribute_tensor(weight.data, ep, [Shard(0)])
            setattr(module, name, nn.Parameter(sharded, requires_grad=weight.requires_grad))
        module.forward = types.MethodType(_ep_forward, module)
        module.ep_group = ep.get_group()
    return experts


def _local(weight: torch.Tensor) -> torch.Tensor:
    """This rank's experts of a fused weight (a DTensor on "ep" once FSDP2 has gathered its "edp" shards)."""
    return weight.to_local() if isinstance(weight, DTensor) else weight


def _ep_forward(self: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    """The experts' forward over the ep group: exchange (token, expert) pairs, run the local experts, send back."""
    group = self.ep_group
    ep = dist.get_world_size(group)
    gate_up, down = _local(self.gate_up_proj), _local(self.down_proj)
    per_rank = gate_up.shape[0]
    experts = top_k_index.reshape(-1)
    order = torch.argsort(experts, stable=True)  # pairs grouped by expert, hence by the rank that owns it
    token = order // top_k_index.shape[1]
    send = torch.bincount(experts // per_rank, minlength=ep)
    recv = _exchange_counts(send, group)
    sends, recvs = send.tolist(), recv.tolist()
    inputs = _all_to_all(hidden[token], recvs, sends, group)
    their = torch.empty(sum(recvs), dtype=torch.int64, device=hidden.device)
    dist.all_to_all_single(their, experts[order].to(torch.int64), recvs, sends, group=group)
    outputs = _run_local(self, inputs, their - dist.get_rank(group) * per_rank, gate_up, down)
    back = _all_to_all(outputs, sends, recvs, group)
    weighted = back * top_k_weights.reshape(-1)[order, None].to(back.dtype)
    return torch.zeros_like(hidden).index_add(0, token, weighted.to(hidden.dtype))


def _all_to_all(rows: torch.Tensor, recv: list[int], send: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """`rows` dealt out (send[r] to rank r), what the others deal here gathered (recv[r] from rank r);
    differentiable: the backward sends the gradients the opposite way."""
    return wait_tensor(all_to_all_single_autograd(rows.contiguous(), recv, send, group))


def _exchange_counts(send: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """How many pairs each rank of `group` sends here, given how many this rank sends to each."""
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv


def _run_local(self: nn.Module, inputs: torch.Tensor, local: torch.Tensor, gate_up, down) -> torch.Tensor:
    """Each received pair through its (local) expert: act(gate) * up, then down."""
    # zero times every weight: the weights stay in the graph when no pair came here, so every rank's FSDP2
    # reduction has a gradient to give
    out = inputs.new_zeros(inputs.shape[0], down.shape[1]) + 0 * (gate_up.sum() + down.sum()).to(inputs.dtype)
    for e in range(gate_up.shape[0]):
        rows = (local == e).nonzero().squeeze(1)
        if rows.numel() == 0:
            continue
        gate, up = nn.functional.linear(inputs[rows], gate_up[e]).chunk(2, dim=-1)
        out = out.index_add(0, rows, nn.functional.linear(self.act_fn(gate) * up, down[e]).to(out.dtype))
    return out
