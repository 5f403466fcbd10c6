"""One forward/backward of the trainer's real model setup (`load_model` on the trainer's mesh), run under torchrun:
rank 0 saves the loss and every parameter's full gradient (DTensors gathered) for the tensor-parallel test.

usage: torchrun --nproc-per-node N tp_probe.py MODEL_DIR TP OUT.pt
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from asyncrl.config.trainer import TrainerModelConfig
from asyncrl.trainer.dist import init_distributed
from asyncrl.trainer.model import load_model


def main(model_dir: str, tp: int, out: str) -> None:
    torch.set_num_threads(1)
    ctx = init_distributed("cpu", tp)
    model = load_model(TrainerModelConfig(name=model_dir, tp=tp), None, ctx.mesh).model
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (2, 24), generator=g)
    pos = torch.cat([torch.arange(10), torch.arange(14)]).repeat(2, 1)  # two packed samples per row
    logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        grads[name] = grad.detach().clone()
    if ctx.is_main:
        torch.save({"loss": loss.detach(), "grads": grads, "local_q": _local_q_shape(model)}, out)
    ctx.close()


def _local_q_shape(model: torch.nn.Module) -> list[int]:
    """The shape of the first layer's q_proj weight on this rank (split by tp when tensor-parallel)."""
    weight = model.model.layers[0].self_attn.q_proj.weight
    return list(weight.to_local().shape if hasattr(weight, "to_local") else weight.shape)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
