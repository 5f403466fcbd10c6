"""AdamW over the trainable parameters and the learning-rate schedules (constant, linear, cosine + warmup)."""

from __future__ import annotations

import math
from collections import defaultdict

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from asyncrl.config.trainer import OptimConfig, SchedulerConfig
from asyncrl.core.errors import UserError


def build_optimizer(params: list[nn.Parameter], cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW over `params` (the trainable ones: all weights, the LoRA adapters, or one run's adapter slot)."""
    if not params:
        raise UserError("the model has no trainable parameters (check model.lora.target_modules)")
    return torch.optim.AdamW(
        params, lr=cfg.lr, betas=(cfg.betas1, cfg.betas2), eps=cfg.eps, weight_decay=cfg.weight_decay
    )


def lr_factor(step: int, cfg: SchedulerConfig, base_lr: float, max_steps: int | None) -> float:
    """Multiplier of the base lr at optimizer step `step` (0-based): linear warmup, then the decay."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.type == "constant":
        return 1.0
    decay_steps = cfg.decay_steps or (max_steps - cfg.warmup_steps if max_steps else None)
    if not decay_steps or decay_steps <= 0:
        raise UserError(f"scheduler.type = '{cfg.type}' needs scheduler.decay_steps or max_steps > warmup_steps")
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    floor = cfg.min_lr / base_lr
    if cfg.type == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return floor + (1.0 - floor) * shape


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: SchedulerConfig, max_steps: int | None) -> LambdaLR:
    base_lr = optimizer.param_groups[0]["lr"]
    if cfg.min_lr > base_lr:
        raise UserError(f"scheduler.min_lr ({cfg.min_lr}) is above optim.lr ({base_lr})")
    lr_factor(cfg.warmup_steps, cfg, base_lr, max_steps)  # fail on a bad config now, not at the warmup's end
    return LambdaLR(optimizer, lambda step: lr_factor(step, cfg, base_lr, max_steps))


def apply_gradients(
    params: list[torch.Tensor], optimizer: torch.optim.Optimizer, scheduler: LambdaLR, max_norm: float, step: int
) -> tuple[float, float]:
    """Clip, step the optimizer and the schedule, zero the grads; returns (grad_norm, lr used).

    A non-finite gradient norm stops the run before the optimizer step, so no bad weights are written.
    """
    grad_norm = clip_grad_norm(params, max_norm)
    if not math.isfinite(grad_norm):
        raise UserError(
            f"gradient norm is {grad_norm} at step {step}; stopped before the optimizer step, no weights "
            "written for it (lower optim.lr, or lower optim.max_norm)"
        )
    lr = scheduler.get_last_lr()[0]
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    if params and params[0].device.type == "cuda":
        torch.cuda.synchronize()
    return grad_norm, lr


def clip_grad_norm(params: list[torch.Tensor], max_norm: float) -> float:
    """Global L2 grad norm over all ranks (FSDP2 grads are DTensors); clips to `max_norm` unless it is 0.

    With tensor parallelism the split layers' grads live on the 2-D mesh and the rest on its "dp" dimension:
    DTensors of different meshes do not mix, so each mesh's norm is reduced alone and the norms combined."""
    groups: dict[object, list[torch.Tensor]] = defaultdict(list)
    for p in params:
        if p.grad is not None:
            groups[getattr(p.grad, "device_mesh", None)].append(p.grad)
    norms = [_full(nn.utils.get_total_norm(grads)) for grads in groups.values()]
    total = float(torch.stack(norms).norm()) if norms else 0.0
    if max_norm > 0 and norms:
        coef = min(1.0, max_norm / (total + 1e-6))  # as nn.utils.clip_grads_with_norm_
        for grads in groups.values():
            torch._foreach_mul_(grads, coef)
    return total


def _full(norm: torch.Tensor) -> torch.Tensor:
    """A norm as a plain tensor on CPU (a DTensor's pending cross-rank reduction done)."""
    return (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).detach().double().cpu()
