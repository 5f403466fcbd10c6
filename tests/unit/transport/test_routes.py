"""The MoE routing record: its wire form, and the read boundary refusing records that do not fit the model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncrl.core.errors import UserError
from asyncrl.transport.batch import read_batch, write_batch
from asyncrl.transport.layout import RunLayout
from asyncrl.transport.routes import RoutingShape, decode, encode
from asyncrl.transport.row import Row

SHAPE = RoutingShape(layers=2, top_k=2, experts=8)


def row(n: int = 5, routes: torch.Tensor | None = None) -> Row:
    return Row(
        input_ids=torch.arange(n),
        position_ids=torch.arange(n),
        loss_mask=torch.tensor([False, False] + [True] * (n - 2)),
        advantages=torch.ones(n),
        inference_logprobs=torch.full((n,), -1.0),
        temperatures=torch.ones(n),
        routed_experts=routes,
    )


def routes(n: int = 5, layers: int = 2, top_k: int = 2, high: int = 8) -> torch.Tensor:
    return torch.randint(0, high, (n, layers, top_k), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))


def test_the_wire_dict_round_trips_and_says_where_it_starts():
    rows = np.arange(24, dtype=np.uint8).reshape(4, 3, 2)
    wire = encode(rows, start=7)
    assert wire["shape"] == [4, 3, 2] and wire["dtype"] == "uint8" and wire["start"] == 7
    assert np.array_equal(decode(wire), rows)
    with pytest.raises(ValueError, match="not a routing record"):
        decode({"data": wire["data"], "shape": [5, 3, 2]})


def test_a_row_with_a_record_that_fits_the_model_is_read():
    wire = row(routes=routes()).to_wire()
    got = Row.from_wire(wire, 100, SHAPE)
    assert torch.equal(got.routed_experts, wire["routed_experts"])
    assert Row.from_wire(row().to_wire(), 100).routed_experts is None  # replay off: none needed


@pytest.mark.parametrize(
    ("record", "said"),
    [
        (None, "carries no routing record"),
        (routes(layers=3), r"shape \(5, 3, 2\), but this model needs \(tokens, MoE layers, top_k\) = \(5, 2, 2\)"),
        (routes(top_k=1), r"= \(5, 2, 2\)"),
        (routes(high=9) | torch.tensor(8, dtype=torch.uint8), "names expert 15, but the model has 8 per layer"),
        (routes(n=4), "holds 4 tokens' routes, the row 5 tokens"),
        (routes().to(torch.int64), "must be a uint8 tensor"),
    ],
)
def test_a_record_that_does_not_fit_is_refused_in_one_line(record, said):
    with pytest.raises(ValueError, match=said) as e:
        Row.from_wire(row(routes=record).to_wire(), 100, SHAPE)
    assert "\n" not in str(e.value)


def test_the_trainer_read_boundary_names_the_file_and_the_record(tmp_path):
    layout = RunLayout(tmp_path)
    write_batch(layout, 0, [[row(routes=routes(layers=3))]])
    with pytest.raises(UserError, match=r"rank_0.pt is malformed: micro-batch 0: routed_experts has shape") as e:
        read_batch(layout, 0, 0, 100, SHAPE)
    assert "\n" not in str(e.value)
    assert read_batch(layout, 0, 0, 100)[0].routed_experts.shape == (5, 3, 2)  # replay off: not checked against a model


def test_a_model_with_more_experts_than_uint8_holds_has_no_record():
    router = torch.nn.Module()
    router.top_k, router.num_experts, router.weight = 2, 300, torch.nn.Parameter(torch.zeros(1))
    model = torch.nn.ModuleList([router])
    with pytest.raises(ValueError, match="300 experts per layer"):
        RoutingShape.of(model)
    assert RoutingShape.of(torch.nn.Linear(2, 2)) is None
