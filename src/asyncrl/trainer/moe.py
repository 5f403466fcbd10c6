"""Router load of a mixture-of-experts model: how evenly a step's tokens went to the experts.

One job: hook every router of the model (a module with `top_k` and `num_experts` whose forward returns the
chosen experts last, as transformers' `Qwen3MoeTopKRouter` does), count the experts chosen per token over a
step, all layers and micro-batches together, and give the step's metrics, summed over ranks:
`moe/load_max_over_mean` (1.0: every expert got its share; E: one expert got everything),
`moe/load_min_over_mean` and `moe/experts_idle_frac` (experts of some layer that got no token).

Invariants: a dense model gets no hooks and no metrics; `take` is a collective on an MoE model (every rank
calls it once per step, in the same order as the other step-end collectives); the ratios do not change when
activation checkpointing runs a layer's forward twice (every count doubles). In a multi-run trainer each run's
session counts the shared forwards of all runs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from asyncrl.transport.routes import routers


class RouterLoad:
    """Counts, per router, the tokens each expert was chosen for since the last `take`."""

    def __init__(self, model: nn.Module):
        self.routers = routers(model)
        experts = self.routers[0].num_experts if self.routers else 0
        self.counts = torch.zeros(len(self.routers), experts, dtype=torch.float64)
        for i, router in enumerate(self.routers):
            router.register_forward_hook(self._counter(i))

    def _counter(self, i: int) -> Callable:
        def count(_module, _inputs, output) -> None:
            chosen = output[-1].detach().reshape(-1)
            if self.counts.device != chosen.device:  # kept where the routers run: no sync per layer
                self.counts = self.counts.to(chosen.device)
            self.counts[i] += torch.bincount(chosen, minlength=self.counts.shape[1]).to(self.counts.dtype)

        return count

    def take(self, all_reduce_sum: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, float]:
        """The step's load metrics (summed over ranks with `all_reduce_sum`), then zeroed; {} for a dense model
        or a step without tokens."""
        if not self.routers:
            return {}
        counts, self.counts = all_reduce_sum(self.counts), torch.zeros_like(self.counts)
        mean = counts.mean(dim=1, keepdim=True)
        if float(mean.min()) == 0.0:
            return {}
        return {
            "moe/load_max_over_mean": float((counts / mean).max(dim=1).values.mean()),
            "moe/load_min_over_mean": float((counts / mean).min(dim=1).values.mean()),
            "moe/experts_idle_frac": float((counts == 0).double().mean()),
        }


def log_part(metrics: dict) -> str:
    """` | moe load max/mean 1.42` for a step's console line (an MoE's), else ""."""
    load = metrics.get("moe/load_max_over_mean")
    return "" if load is None else f" | moe load max/mean {load:.2f}"
