"""The packed training row: the one type the orchestrator packs and writes and the trainer reads and trains on.

A `Row` is one packed row of up to seq_len tokens, six 1-D tensors of one length L:

    input_ids (int64), position_ids (int64; restart at 0 at each sample, which marks boundaries; a
        group's samples may share their prompt: see `transport.prefix` for continuations),
    loss_mask (bool; True on completion tokens the model produced), advantages (float32; per token),
    inference_logprobs (float32; logprob of the token under the sampler, 0 where loss_mask is False),
    temperatures (float32; sampling temperature of the sample each token belongs to)

and, with forward-KL distillation only, two (L, K) fields: teacher_ids (int64; the teacher's listed tokens at
each position, zero-padded) and teacher_targets (float32 >= 0; their target mass, the distillation weight times
the teacher's renormalized probability; 0 on padding and on tokens without a teacher signal). Both or neither.
With routing replay, one (L, layers, top_k) uint8 field: routed_experts (the experts the sampler chose for each
token in each MoE layer: `transport.routes`; padding and fillers: expert 0).

The wire form (`to_wire`, `from_wire`; `transport.batch` saves lists of them per rank) is a plain dict of those
tensors under those names (PRIME-RL's), the absent teacher fields left out: the format of batches already on disk.
`from_wire` is the read boundary: it refuses anything that is not that format (missing fields, wrong types,
shapes or dtypes, token ids outside the vocabulary, non-finite sampler logprobs, temperatures that are not
positive, an invalid shared prefix, a routing record that does not fit the model) with a ValueError saying the
first thing wrong, and ignores other keys.
A row built in the process (packing, fake data) is checked for shape only (`check`); reads check everything,
a few reductions per field: cheap next to one forward pass.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Self

import torch

from asyncrl.transport.prefix import check_shared, unshare
from asyncrl.transport.routes import RoutingShape

TOKEN_FIELDS = ("input_ids", "position_ids", "loss_mask", "advantages", "inference_logprobs", "temperatures")
TEACHER_FIELDS = ("teacher_ids", "teacher_targets")  # optional, both or neither: (L, K)
ROUTES = "routed_experts"  # optional: (L, layers, top_k) uint8
INTEGER_FIELDS = ("input_ids", "position_ids", "teacher_ids")
FLOAT_FIELDS = ("advantages", "inference_logprobs", "temperatures", "teacher_targets")
DTYPES = {f: torch.long for f in INTEGER_FIELDS} | {f: torch.float32 for f in FLOAT_FIELDS} | {"loss_mask": torch.bool}
DTYPES[ROUTES] = torch.uint8
KEPT_BY_FILLERS = ("input_ids", "position_ids", "temperatures", "teacher_ids")  # `masked` zeroes the rest


@dataclass
class Row:
    """One packed row (the module's docstring); subclasses add per-token structure derived from it."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    inference_logprobs: torch.Tensor
    temperatures: torch.Tensor
    teacher_ids: torch.Tensor | None = None
    teacher_targets: torch.Tensor | None = None
    routed_experts: torch.Tensor | None = None

    @classmethod
    def from_wire(cls, data: object, vocab_size: int | None = None, routing: RoutingShape | None = None) -> Row:
        """The row a wire dict holds, checked (token ids against `vocab_size` when given; with `routing`, a
        routing record for that model is required); ValueError otherwise."""
        if not isinstance(data, dict):
            raise ValueError(f"a {type(data).__name__}, not a dict of tensors")
        if missing := [k for k in TOKEN_FIELDS if k not in data]:
            raise ValueError(f"lacks the fields {missing}")
        row = cls(**{k: data[k] for k in (*TOKEN_FIELDS, *TEACHER_FIELDS, ROUTES) if k in data})
        if (problem := row.problem(vocab_size) or row.routing_problem(routing)) is not None:
            raise ValueError(problem)
        return row

    def to_wire(self) -> dict[str, torch.Tensor]:
        """The row's wire dict: its tensors by name, an absent teacher field left out."""
        return {f.name: t for f in fields(Row) if (t := getattr(self, f.name)) is not None}

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Self:
        """This row with `fn` applied to each of its tensors (the token axis is the first of every field)."""
        return replace(self, **{k: fn(t) for k, t in self.to_wire().items()})

    def to(self, device: torch.device) -> Self:
        """This row on `device`, every field in its dtype of the format (int64 ids and positions, bool loss mask,
        float32 for the rest)."""
        return replace(self, **{k: t.to(device, DTYPES[k], non_blocking=True) for k, t in self.to_wire().items()})

    def masked(self) -> Self:
        """A filler: the same tokens with nothing to train on (loss mask, advantages, logprobs, teacher mass 0)."""
        return replace(
            self, **{k: t.clone() if k in KEPT_BY_FILLERS else torch.zeros_like(t) for k, t in self.to_wire().items()}
        )

    def expanded(self) -> Self:
        """The same row with no sharing (`transport.prefix.unshare`), or this row when it shares nothing."""
        if (plain := unshare(self.position_ids)) is None:
            return self
        order, positions = plain
        return replace(self.map(lambda t: t[order]), position_ids=positions)

    def check(self) -> None:
        """ValueError unless the fields are tensors of the format's shapes (their values are not read)."""
        if (problem := self._shape_problem()) is not None:
            raise ValueError(f"packed row: {problem}")

    def _shape_problem(self) -> str | None:
        """What is wrong with the fields' types and shapes, or None."""
        if not_tensors := [k for k in TOKEN_FIELDS if not isinstance(getattr(self, k), torch.Tensor)]:
            return f"{not_tensors} are not tensors"
        shapes = {k: tuple(getattr(self, k).shape) for k in TOKEN_FIELDS}
        if len(set(shapes.values())) != 1 or self.input_ids.dim() != 1 or self.input_ids.numel() == 0:
            return f"the fields must be non-empty 1-D tensors of one length, got shapes {shapes}"
        return self._teacher_shape_problem() or self._routes_shape_problem()

    def _routes_shape_problem(self) -> str | None:
        """The routing record, when present: a uint8 tensor (L, layers, top_k), L the row's length."""
        routes = self.routed_experts
        if routes is None:
            return None
        if not isinstance(routes, torch.Tensor) or routes.dtype != torch.uint8 or routes.dim() != 3:
            return "routed_experts must be a uint8 tensor (tokens, MoE layers, top_k)"
        if routes.shape[0] != self.input_ids.shape[0]:
            return f"routed_experts holds {routes.shape[0]} tokens' routes, the row {self.input_ids.shape[0]} tokens"
        return None

    def routing_problem(self, routing: RoutingShape | None) -> str | None:
        """With `routing` (replay on): what is wrong with the row's record for that model, or None."""
        if routing is None:
            return None
        if self.routed_experts is None:
            return (
                "it carries no routing record (routed_experts), which router_replay needs: the inference server must "
                "record the experts it routes to (the embedded engine's enable_return_routed_experts, set by rl)"
            )
        return routing.problem(self.routed_experts, self.input_ids.shape[0])

    def problem(self, vocab_size: int | None = None) -> str | None:
        """What is wrong with the row (the format in the module's docstring), or None."""
        return (
            self._shape_problem()
            or self._dtype_problem()
            or self._value_problem(vocab_size)
            or self._teacher_problem(vocab_size)
        )

    def _teacher_shape_problem(self) -> str | None:
        """The teacher fields, when present: both, tensors of shape (L, K >= 1), L the row's length."""
        present = [k for k in TEACHER_FIELDS if getattr(self, k) is not None]
        if not present:
            return None
        if len(present) == 1:
            return f"has {present[0]} without {[k for k in TEACHER_FIELDS if k not in present][0]} (both or neither)"
        if not all(isinstance(getattr(self, k), torch.Tensor) for k in TEACHER_FIELDS):
            return "teacher_ids / teacher_targets are not tensors"
        shapes = {k: tuple(getattr(self, k).shape) for k in TEACHER_FIELDS}
        length = self.input_ids.shape[0]
        if len(set(shapes.values())) != 1 or len(shapes["teacher_ids"]) != 2 or shapes["teacher_ids"][0] != length:
            return f"teacher fields must be (L, K) tensors of one shape with L = {length} tokens, got {shapes}"
        if shapes["teacher_ids"][1] < 1:
            return "teacher fields list no token per position (K = 0)"
        return None

    def _dtype_problem(self) -> str | None:
        """Integer ids and positions (and teacher_ids), a bool loss mask, float for the rest (teacher_targets too)."""
        wire = self.to_wire()
        ints = [k for k in INTEGER_FIELDS if k in wire]
        wrong = [k for k in ints if wire[k].is_floating_point() or wire[k].is_complex() or wire[k].dtype == torch.bool]
        wrong += [k for k in FLOAT_FIELDS if k in wire and not wire[k].is_floating_point()]
        wrong += ["loss_mask"] if self.loss_mask.dtype != torch.bool else []
        if wrong:
            dtypes = {k: str(wire[k].dtype).removeprefix("torch.") for k in wrong}
            return f"wrong dtypes {dtypes} ({', '.join(INTEGER_FIELDS)}: integer; loss_mask: bool; the rest: float)"
        return None

    def _value_problem(self, vocab_size: int | None) -> str | None:
        ids, pos = self.input_ids, self.position_ids
        if vocab_size is not None and (bad := _first(~((ids >= 0) & (ids < vocab_size)))) is not None:
            return f"input_ids[{bad}] = {int(ids[bad])} is outside the model's vocabulary (0..{vocab_size - 1})"
        if (bad := _first(pos < 0)) is not None:
            return f"position_ids[{bad}] = {int(pos[bad])} is negative"
        if (bad := _first(~self.inference_logprobs.isfinite())) is not None:
            value = float(self.inference_logprobs[bad])
            return f"inference_logprobs[{bad}] = {value} (the sampler's logprob of a token it sampled must be finite)"
        temps = self.temperatures
        if (bad := _first(~(temps.isfinite() & (temps > 0)))) is not None:
            return (
                f"temperatures[{bad}] = {float(temps[bad])} (RL needs finite sampling temperatures > 0: a greedy "
                "sample has no distribution to correct for; give the orchestrator sampling.temperature > 0)"
            )
        try:
            check_shared(pos, self.loss_mask)
        except ValueError as e:
            return str(e)
        return None

    def _teacher_problem(self, vocab_size: int | None) -> str | None:
        if self.teacher_ids is None:
            return None
        ids, targets = self.teacher_ids, self.teacher_targets
        high = vocab_size if vocab_size is not None else torch.iinfo(torch.int64).max
        if (bad := _first((~((ids >= 0) & (ids < high))).any(-1))) is not None:
            return f"teacher_ids[{bad}] = {ids[bad].tolist()} lists a token outside the model's vocabulary"
        if (bad := _first((~(targets.isfinite() & (targets >= 0))).any(-1))) is not None:
            return f"teacher_targets[{bad}] = {targets[bad].tolist()} (target mass must be finite and >= 0)"
        return None


def _first(bad: torch.Tensor) -> int | None:
    """The index of the first True in a 1-D bool tensor, or None."""
    return int(bad.nonzero()[0, 0]) if bool(bad.any()) else None
