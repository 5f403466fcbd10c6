"""One forward/backward of the trainer's real model setup (`load_model` with `model.ep`), run under torchrun: the
batch's rows are dealt to the ranks, each rank's summed token loss is scaled as the trainer scales it (ranks /
the batch's loss tokens), and rank 0 saves the loss, every parameter's full gradient (DTensors gathered) and its
local share of the first layer's experts, for the expert-parallel test.

usage: torchrun --nproc-per-node N ep_probe.py MODEL_DIR EP OUT.pt
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from asyncrl.config.trainer import TrainerModelConfig
from asyncrl.trainer.dist import init_distributed
from asyncrl.trainer.model import load_model

ROWS, LENGTH = 4, 24


def main(model_dir: str, ep: int, out: str) -> None:
    torch.set_num_threads(1)
    ctx = init_distributed("cpu", 1, ep)
    model = load_model(TrainerModelConfig(name=model_dir, ep=ep), None, ctx.mesh).model
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (ROWS, LENGTH), generator=g).chunk(ctx.world_size)[ctx.rank]
    pos = torch.cat([torch.arange(10), torch.arange(LENGTH - 10)]).repeat(len(ids), 1)  # two packed samples a row
    logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    flat = logits[:, :-1].reshape(-1, logits.shape[-1]).float()
    loss = F.cross_entropy(flat, ids[:, 1:].reshape(-1), reduction="sum") * ctx.world_size / (ROWS * (LENGTH - 1))
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        grads[name] = grad.detach().clone()
    total = loss.detach().clone()
    dist.all_reduce(total)
    if ctx.is_main:
        torch.save({"loss": total / ctx.world_size, "grads": grads, "local_experts": _local_experts(model)}, out)
    ctx.close()


def _local_experts(model: torch.nn.Module) -> int:
    """How many experts of the first layer this rank holds."""
    weight = model.model.layers[0].mlp.experts.gate_up_proj
    return (weight.to_local() if hasattr(weight, "to_local") else weight).shape[0]


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
