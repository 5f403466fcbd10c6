"""Process-group setup for the trainers: torchrun or a lone process, gloo on CPU, NCCL on CUDA, and the mesh.

The mesh is 1-D ("dp",) over every rank, or with tensor parallelism (tp > 1) 2-D ("dp", "tp") of shape
(world / tp, tp): the ranks of one "tp" row hold the same batch and split each layer's weights; data is dealt
to the "dp" coordinates (`dp_rank` of `dp_size`), and `all_reduce_sum` sums over them only, so a token
counted on every rank of a tp row counts once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from asyncrl.core.errors import UserError
from asyncrl.utils.process import free_port


@dataclass
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: DeviceMesh
    owns_group: bool  # we created the default group, so we destroy it at the end
    tp: int = 1  # ranks that split one batch's layers (tensor parallelism)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_size(self) -> int:
        """Ranks that get different data: world_size / tp."""
        return self.world_size // self.tp

    @property
    def dp_rank(self) -> int:
        """This rank's share of the data (ranks of one tp row share it)."""
        return self.rank // self.tp

    @property
    def dp_mesh(self) -> DeviceMesh:
        """The mesh FSDP2 shards over: the "dp" dimension."""
        return self.mesh["dp"] if self.tp > 1 else self.mesh

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def all_reduce_sum(self, values: torch.Tensor) -> torch.Tensor:
        """Sum a tensor over the data-parallel ranks (in place on a device copy); returns the result on CPU.
        The ranks of one tp row hold the same values, so each row counts once."""
        out = values.detach().to(self.device, torch.float64)
        if self.dp_size > 1:
            dist.all_reduce(out, group=self.dp_mesh.get_group() if self.tp > 1 else None)
        return out.cpu()

    def all_reduce_max(self, value: int) -> int:
        """The largest `value` over ranks."""
        out = torch.tensor([value], dtype=torch.int64, device=self.device)
        if self.world_size > 1:
            dist.all_reduce(out, op=dist.ReduceOp.MAX)
        return int(out.item())

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` (picklable), on every rank."""
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def first_error(self, error: str | None) -> str | None:
        """The first rank's non-None `error`, prefixed with that rank, on every rank (None: no rank had one)."""
        if self.world_size == 1:
            return error
        errors: list[str | None] = [None] * self.world_size
        dist.all_gather_object(errors, error)
        return next((f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None), None)

    def close(self) -> None:
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()


def resolve_device(device: str) -> str:
    """'auto' -> 'cuda' when a GPU is visible, else 'cpu'; asking for cuda without one is a user error."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("device = 'cuda' but no CUDA GPU is visible; use --device cpu (or auto)")
    return device


def init_distributed(device: str = "auto", tp: int = 1, ep: int = 1) -> DistContext:
    """Join (or create) the default process group and build the mesh: ("dp",) over all ranks, or ("dp", "tp")
    with `tp` > 1 (which must divide the ranks). `ep` (expert parallelism, `trainer.ep`) must divide them too; its
    mesh is the model's.

    Under torchrun the env (RANK, WORLD_SIZE, MASTER_ADDR, ...) is used; a plain process makes a
    1-rank group on a free local port so FSDP2 and DCP run the same code path either way.
    """
    kind = resolve_device(device)
    check_divides("tp", tp, _world_to_be())
    check_divides("ep", ep, _world_to_be())  # before the group exists: nothing to tear down on a bad value
    owns = False
    if not dist.is_initialized():
        # CUDA runs still get a gloo side for CPU tensors (object collectives, async checkpoint group).
        backend = "cpu:gloo,cuda:nccl" if kind == "cuda" else "gloo"
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend=backend)
        else:
            dist.init_process_group(backend=backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        owns = True
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if kind == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise UserError(
                f"local rank {local_rank} has no GPU ({torch.cuda.device_count()} visible); "
                "use --nproc-per-node <= the number of GPUs"
            )
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    return DistContext(rank, world, local_rank, dev, build_mesh(kind, world, tp), owns, tp)


def _world_to_be() -> int:
    """The number of ranks of the group `init_distributed` joins or makes."""
    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ["WORLD_SIZE"]) if "RANK" in os.environ and "WORLD_SIZE" in os.environ else 1


def check_divides(what: str, n: int, world: int) -> None:
    """A user error unless `n` (model.`what`: tp or ep) divides the `world` ranks."""
    if world % n:
        raise UserError(
            f"model.{what} = {n} does not divide the {world} trainer rank(s): use a --model.{what} that divides "
            f"them, or a multiple of {n} ranks (--trainer-cpu-processes / --nproc-per-node)"
        )


def build_mesh(kind: str, world: int, tp: int) -> DeviceMesh:
    """("dp",) over `world` ranks, or ("dp", "tp") of shape (world / tp, tp)."""
    if tp == 1:
        return init_device_mesh(kind, (world,), mesh_dim_names=("dp",))
    return init_device_mesh(kind, (world // tp, tp), mesh_dim_names=("dp", "tp"))


PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "NCCL communicator was aborted")


def peer_lost(error: BaseException) -> str | None:
    """The line of a collective's error that says another rank went away (gloo / NCCL), or None."""
    text = str(error)
    if not (isinstance(error, dist.DistError) or any(p in text for p in PEER_LOST)):
        return None
    line = next((x for x in text.splitlines() if any(p in x for p in PEER_LOST)), text.splitlines()[0] if text else "")
    return line.split("] ", 1)[-1].split(". This is typically", 1)[0].strip()  # gloo's source location and advice
