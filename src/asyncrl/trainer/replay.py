"""Routing replay (R3): the trainer's MoE layers use the experts the sampler chose for each token.

One job: with `[trainer.model] router_replay = true`, a forward hook on every router (transformers'
`Qwen3MoeTopKRouter` contract: it returns `(router_logits, top_k_weights, top_k_index)`) swaps its choice for the
micro-batch's routing record (`transport.routes`, the engine's): the experts are the recorded ones, their gate
weights are recomputed from this forward's own router logits (softmax over all experts, gathered at the replayed
ids, renormalized when the model normalizes its top-k), so the loss flows through the experts the sampler used
and the router still learns from it. Tokens a forward adds (padding) replay expert 0, and carry no loss.

Invariants: the record of a micro-batch stays set until the next one is (activation checkpointing recomputes a
layer in the backward pass with the same experts); a forward whose token count does not match the record is a
RuntimeError (never a silent misalignment); `take` gives `moe/replay_agreement`, the fraction of (position,
layer) pairs whose own top-k set was the replayed one, over the positions whose logits score a loss token (1.0:
the trainer would have routed every token the loss reads as the sampler did). `recorded_routes` gives what a
forward's routers chose (the packing check pins a packed forward's routing on its samples run alone).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from asyncrl.transport.routes import RoutingShape, routers


class RouterReplay:
    """Hooks on a model's routers that replay a routing record (module docstring)."""

    def __init__(self, model: nn.Module, name: str = "the model"):
        fix = "set trainer.model.router_replay = false for a dense model"
        self.shape = RoutingShape.required(model, "router_replay", name, fix)
        self.routes: torch.Tensor | None = None  # [..., layers, top_k] of the current micro-batch's tokens
        self.counted: torch.Tensor | None = None  # [tokens] bool: the positions `moe/replay_agreement` counts
        self._agree = torch.zeros(2, dtype=torch.float64)  # (agreeing, all) (token, layer) pairs
        self._hooks = [
            router.register_forward_hook(self._replayer(layer)) for layer, router in enumerate(routers(model))
        ]

    def close(self) -> None:
        """Remove the hooks: the model routes by itself again."""
        for hook in self._hooks:
            hook.remove()

    def set(self, routes: torch.Tensor | None, counted: torch.Tensor) -> None:
        """The record of the next forward's tokens ([rows, length, layers, top_k], the rows' token order) and the
        positions the agreement counts ([rows, length] bool)."""
        if routes is None:
            raise RuntimeError("router_replay: a micro-batch without routing records reached the forward")
        self.routes, self.counted = routes, counted.reshape(-1)

    def _replayer(self, layer: int) -> Callable:
        def replay(module: nn.Module, _inputs, output: tuple) -> tuple:
            logits, _, own = output
            chosen = self.routes[..., layer, :].reshape(-1, self.shape.top_k).to(own.device, torch.long)
            if chosen.shape[0] != logits.shape[0]:
                raise RuntimeError(
                    f"router_replay: layer {layer} routes {logits.shape[0]} tokens, the record has {chosen.shape[0]}"
                )
            self._count(own, chosen)
            weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, chosen)
            if getattr(module, "norm_topk_prob", False):
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return logits, weights.to(logits.dtype), chosen

        return replay

    @torch.no_grad()
    def _count(self, own: torch.Tensor, chosen: torch.Tensor) -> None:
        same = (own.sort(dim=-1).values == chosen.sort(dim=-1).values).all(dim=-1)[self.counted.to(own.device)]
        if self._agree.device != same.device:
            self._agree = self._agree.to(same.device)
        self._agree += torch.stack([same.sum(), torch.tensor(same.numel(), device=same.device)]).to(self._agree)

    def take(self) -> dict[str, float]:
        """This rank's `moe/replay_agreement` since the last take (counted again when a layer is recomputed)."""
        agree, self._agree = self._agree.cpu(), torch.zeros_like(self._agree)
        return {"moe/replay_agreement": float(agree[0] / agree[1])} if agree[1] > 0 else {}


@contextlib.contextmanager
def recorded_routes(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Within: each router appends the experts it chose ([tokens, top_k]) to the yielded list, in layer order."""
    chosen: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda _m, _i, out: chosen.append(out[-1].detach())) for r in routers(model)]
    try:
        yield chosen
    finally:
        for hook in hooks:
            hook.remove()


def scoring_positions(loss_mask: torch.Tensor, parents: torch.Tensor | None) -> torch.Tensor:
    """[rows, length] bool: the positions whose logits score a loss token (its parent in a shared row, else t-1)."""
    if parents is None:
        return torch.nn.functional.pad(loss_mask[:, 1:], (0, 1))
    hits = torch.zeros(loss_mask.shape, dtype=torch.int32, device=loss_mask.device)
    hits.scatter_add_(1, parents.clamp(min=0), (loss_mask & (parents >= 0)).to(torch.int32))
    return hits > 0
