"""Tensor data of safetensors files, read safely, and checked to be weights (floating point, finite).

Shared by both engines (the embedded engine for whole weight dirs and adapters, the API for adapters).
A file is read with plain reads into memory, never memory-mapped: a file another process truncates or
rewrites meanwhile is a 400 (not a complete file) or a 409 (it changed while read), never a SIGBUS.
The file is read into a uint8 tensor (`readinto`, which lets go of the GIL) and its tensors are views into it
(`load_tensors`): `Path.read_bytes` and safetensors' own `load` each copy every byte while they hold the GIL
(~170 and ~113 ms for 192 MiB), which stalled the engine thread's decoding during each weight update.
Imports torch: the API's other modules import this one only inside the functions that need it.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from asyncrl.inference.api.errors import InvalidRequest
from asyncrl.inference.api.weight_dir import one_line
from asyncrl.transport.weights import HEADER_LIMIT

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip


def read_bytes(f: Path, param: str) -> torch.Tensor:
    """The whole file as a uint8 tensor, read plainly; 409 when its size or mtime changed while it was read."""
    try:
        before = os.stat(f)
        data = _read_into(f, before.st_size)
        after = os.stat(f)
    except OSError as e:
        raise InvalidRequest(f"cannot read {f}: {one_line(e)}", param=param) from e
    if len(data) != after.st_size or (before.st_size, before.st_mtime_ns) != (after.st_size, after.st_mtime_ns):
        raise InvalidRequest(
            f"{f} changed while it was being read (another process is writing it): send the request again "
            "once the file is complete",
            param=param,
            status=409,
        )
    return data


def _read_into(f: Path, size: int) -> torch.Tensor:
    """Up to `size` bytes of `f` (fewer if it is shorter now) into a fresh uint8 tensor."""
    buf = torch.empty(size, dtype=torch.uint8)
    view, done = memoryview(buf.numpy()), 0
    with open(f, "rb", buffering=0) as file:
        while done < size and (got := file.readinto(view[done:])):
            done += got
    return buf[:done]


def read_file(f: Path, param: str) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file, in memory (on the CPU)."""
    data = read_bytes(f, param)
    try:
        return load_tensors(data)
    except ValueError as e:  # corrupt / truncated file: the user's problem, not a server error
        raise InvalidRequest(f"cannot read {f}: not a complete safetensors file ({one_line(e)})", param=param) from e


def load_tensors(data: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensors of safetensors `data` (uint8), as views into it where aligned; ValueError saying what is wrong
    with the framing."""
    if len(data) < 8:
        raise ValueError(f"{len(data)} bytes: shorter than the header's length field")
    length = int.from_bytes(data[:8].numpy().tobytes(), "little")
    if length > min(HEADER_LIMIT, len(data) - 8):
        raise ValueError(f"a header of {length} bytes in a file of {len(data)}")
    try:
        header = json.loads(data[8 : 8 + length].numpy().tobytes())
    except ValueError as e:
        raise ValueError(f"its header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object")
    entries = {
        name: _entry(name, info, len(data) - 8 - length) for name, info in header.items() if name != "__metadata__"
    }
    end = 0
    for name, (_, _, start, stop) in sorted(entries.items(), key=lambda e: e[1][2]):
        if start < end:
            raise ValueError(f"tensor {name!r} overlaps another")
        end = stop
    return {name: _view(data, 8 + length, *entry) for name, entry in entries.items()}


def _entry(name: str, info: object, size: int) -> tuple[torch.dtype, list[int], int, int]:
    """(dtype, shape, start, stop) of a header entry, checked to lie within the `size` bytes of data."""
    try:
        dtype, dims, offsets = DTYPES[info["dtype"]], info["shape"], info["data_offsets"]  # type: ignore[index]
        if not isinstance(dims, list) or not isinstance(offsets, list) or any(isinstance(x, bool) for x in dims):
            raise TypeError
        shape, (start, stop) = [int(d) for d in dims], (int(x) for x in offsets)
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"tensor {name!r} has a malformed header entry") from None
    if min(shape, default=0) < 0 or not 0 <= start <= stop <= size or stop - start != math.prod(shape) * dtype.itemsize:
        raise ValueError(f"tensor {name!r}: bytes {start}..{stop} of {size} do not hold a {shape} {info['dtype']}")
    return dtype, shape, start, stop


def _view(data: torch.Tensor, base: int, dtype: torch.dtype, shape: list[int], start: int, stop: int) -> torch.Tensor:
    if stop == start:
        return torch.empty(shape, dtype=dtype)
    part = data[base + start : base + stop]
    if (base + start) % dtype.itemsize:  # not aligned for a view as `dtype`: a copy of its own
        part = part.clone()
    return part.view(dtype).reshape(shape)


def check_values(tensors: dict[str, torch.Tensor], where: str, param: str) -> None:
    """Every tensor is floating point and finite (no NaN or inf); else 400 naming the first bad one."""
    for name, t in tensors.items():
        if not t.is_floating_point():
            raise InvalidRequest(f"{where}: tensor '{name}' is {t.dtype}, not floating point", param=param)
        if not bool(torch.isfinite(t).all()):
            raise InvalidRequest(f"{where}: tensor '{name}' holds NaN or inf values", param=param)
