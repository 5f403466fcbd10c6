"""Safetensors files read as views into one uint8 tensor (`api.tensor_values`): the same tensors safetensors
reads, and a ValueError naming what is wrong with a file's framing, whatever its header says."""

from __future__ import annotations

import json
import re
import struct

import pytest
import torch
from safetensors.torch import load, save

from asyncrl.inference.api.tensor_values import load_tensors


def as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def test_the_tensors_are_safetensors_own():
    tensors = {"a": torch.randn(3, 4).to(torch.bfloat16), "b": torch.arange(5), "c": torch.zeros(0, 3)}
    tensors |= {"s": torch.tensor(2.5), "d": torch.randn(7).double(), "m": torch.tensor([True, False])}
    data = save(tensors, metadata={"format": "pt"})
    ours, theirs = load_tensors(as_tensor(data)), load(data)
    assert ours.keys() == theirs.keys()
    for name, t in theirs.items():
        assert ours[name].dtype == t.dtype and torch.equal(ours[name], t), name


def framed(header: dict, body: bytes, pad: int = 0) -> torch.Tensor:
    text = json.dumps(header).encode() + b" " * pad
    return as_tensor(struct.pack("<Q", len(text)) + text + body)


def test_an_unaligned_tensor_is_read_right():
    values = torch.arange(4, dtype=torch.float32)
    got = load_tensors(
        framed({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, values.numpy().tobytes(), 1)
    )
    assert torch.equal(got["x"], values)


@pytest.mark.parametrize(
    "header, body, said",
    [
        ({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8, "bytes 0..16 of 8 do not hold"),
        ({"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 16]}}, b"\0" * 16, "do not hold a [3] F32"),
        ({"x": {"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}}, b"\0" * 16, "do not hold"),
        ({"x": {"dtype": "Q4", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 16, "malformed header entry"),
        ({"x": {"dtype": "F32", "shape": "4", "data_offsets": [0, 16]}}, b"\0" * 16, "malformed header entry"),
        ({"x": [1, 2]}, b"", "malformed header entry"),
        (
            {"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
             "y": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}},
            b"\0" * 16,
            "overlaps another",
        ),
    ],
)  # fmt: skip
def test_a_bad_header_is_a_value_error(header, body, said):
    with pytest.raises(ValueError, match=re.escape(said)):
        load_tensors(framed(header, body))


def test_bad_framing_is_a_value_error():
    with pytest.raises(ValueError, match="shorter than the header's length field"):
        load_tensors(as_tensor(b"\0" * 5))
    with pytest.raises(ValueError, match="a header of 18446744073709551615 bytes"):
        load_tensors(as_tensor(b"\xff" * 8 + b"{}"))
    with pytest.raises(ValueError, match="not JSON"):
        load_tensors(as_tensor(struct.pack("<Q", 3) + b"{x}"))
    with pytest.raises(ValueError, match="not a JSON object"):
        load_tensors(as_tensor(struct.pack("<Q", 2) + b"[]"))
