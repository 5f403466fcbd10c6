"""The routing record of a mixture of experts: which experts each token went to, in every MoE layer.

One job: the record's shape, its checks and its wire form, shared by the engine that records it, the
orchestrator that carries it and the trainer that replays it (routing replay, R3). A record is a uint8 array
`[tokens, layers, top_k]`: row t holds the experts the sampler's router chose for token t in each MoE layer
(`layers` counts the MoE blocks, in model order). On `/inference/v1/generate` a choice carries it as
`routed_experts = {"data": base64 of the bytes, "shape": [n, layers, top_k], "dtype": "uint8", "start": s}`:
rows for positions s.. of prompt + completion, the completion's last token excluded (no forward pass computes
it; verifiers v1 gives that position a copy of the row before it).

Invariants: ids fit uint8, so a model with more than 256 experts has no record (`RoutingShape.of` refuses it);
`problem` names the first thing wrong with a record for a given model shape, or None; `routers` finds the same
modules, in the same order, in the engine's model and the trainer's.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from asyncrl.core.errors import UserError

MAX_EXPERTS = 256  # ids are uint8


def routers(model: nn.Module) -> list[nn.Module]:
    """The model's MoE routers (modules with `top_k`, `num_experts` and a `weight`), in layer order; [] if dense."""
    return [m for m in model.modules() if hasattr(m, "top_k") and hasattr(m, "num_experts") and hasattr(m, "weight")]


@dataclass(frozen=True)
class RoutingShape:
    """What a routing record must match: MoE layers, experts per token, experts per layer."""

    layers: int
    top_k: int
    experts: int

    @classmethod
    def of(cls, model: nn.Module) -> RoutingShape | None:
        """The model's routing shape; None for a dense model. ValueError for one whose ids do not fit uint8."""
        found = routers(model)
        if not found:
            return None
        shape = cls(len(found), int(found[0].top_k), int(found[0].num_experts))
        if shape.experts > MAX_EXPERTS:
            raise ValueError(f"{shape.experts} experts per layer: routing records hold uint8 ids (at most 256)")
        return shape

    @classmethod
    def required(cls, model: nn.Module, setting: str, name: str, fix: str) -> RoutingShape:
        """The routing shape of `model` (called `name`), which `setting` needs: a UserError naming `fix` for a
        dense model, and one for a model whose expert ids do not fit a record."""
        try:
            shape = cls.of(model)
        except ValueError as e:
            raise UserError(f"{setting}: {e}") from None
        if shape is None:
            raise UserError(f"{setting}: {name} is not a mixture of experts (it has no routers); {fix}")
        return shape

    def problem(self, routes: object, tokens: int) -> str | None:
        """What is wrong with `routes` as the record of `tokens` tokens for this model, or None."""
        if not isinstance(routes, torch.Tensor):
            return f"routed_experts is a {type(routes).__name__}, not a tensor"
        if routes.dtype != torch.uint8:
            return f"routed_experts has dtype {str(routes.dtype).removeprefix('torch.')}, not uint8"
        want = (tokens, self.layers, self.top_k)
        if tuple(routes.shape) != want:
            return (
                f"routed_experts has shape {tuple(routes.shape)}, but this model needs (tokens, MoE layers, top_k) "
                f"= {want}: the batch was sampled from another model"
            )
        if routes.numel() and int(routes.max()) >= self.experts:
            return f"routed_experts names expert {int(routes.max())}, but the model has {self.experts} per layer"
        return None


def encode(rows: np.ndarray, start: int = 0) -> dict:
    """A record (rows for positions start..) as its wire dict."""
    rows = np.ascontiguousarray(rows, dtype=np.uint8)
    data = base64.b64encode(rows.tobytes()).decode("ascii")
    return {"data": data, "shape": list(rows.shape), "dtype": "uint8", "start": start}


def decode(payload: dict) -> np.ndarray:
    """The rows a wire dict holds; ValueError when it is not one."""
    try:
        raw = base64.b64decode(payload["data"])
        return np.frombuffer(raw, dtype=np.dtype(payload.get("dtype", "uint8"))).reshape(payload["shape"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"routed_experts is not a routing record ({type(e).__name__}: {e})") from None


def as_tensor(routes: object) -> torch.Tensor:
    """A sample's record (a uint8 array [tokens, layers, top_k], as verifiers v1 gives it) as a tensor."""
    return torch.from_numpy(np.ascontiguousarray(routes, dtype=np.uint8))
