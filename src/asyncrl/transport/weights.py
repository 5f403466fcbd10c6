"""Is a published weight dir (`broadcast/step_n`, `weights/step_n`) whole? A check of its safetensors files' framing.

A safetensors file is an 8-byte little-endian header length, a JSON header giving each tensor's byte range
(`data_offsets`, relative to the end of the header), then the data. A file cut short (a disk fault, a copy
that stopped) ends before the last range does; `weights_problem` finds that from the headers alone, without
reading the tensors, so it is cheap enough to run before a weight dir is handed to the inference server.
The STABLE marker says a publish finished; this says the bytes are still all there.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import BinaryIO

HEADER_LIMIT = 100 * 2**20  # safetensors' own bound on the JSON header


def weights_problem(path: Path) -> str | None:
    """What is wrong with the safetensors files of weight dir `path` (and its adapter/), or None (also when it
    holds none: that is the loader's to report)."""
    for file in sorted(path.glob("*.safetensors")) + sorted(path.glob("*/*.safetensors")):
        if (problem := safetensors_problem(file)) is not None:
            return f"{file} {problem}"
    return None


def safetensors_problem(file: Path) -> str | None:
    """Why `file` is not a whole safetensors file (framing only), or None."""
    size = file.stat().st_size
    with file.open("rb") as f:
        try:
            length, header = read_header(f, size)
        except ValueError as e:
            return str(e)
    ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__" and isinstance(t, dict)]
    expected = 8 + length + max(ends, default=0)
    if size < expected:
        return f"is truncated ({size} of {expected} bytes)"
    return None


def read_header(f: BinaryIO, size: int) -> tuple[int, dict]:
    """The byte length and the JSON header of safetensors file `f` (open, at its start; `size` bytes in all),
    read with plain reads; ValueError saying what is wrong with the file when its framing is not safetensors."""
    head = f.read(8)
    if len(head) < 8:
        raise ValueError(f"is truncated ({size} bytes, not even a header)")
    (length,) = struct.unpack("<Q", head)
    if length > HEADER_LIMIT or 8 + length > size:
        raise ValueError(f"is truncated or not safetensors (header of {length} bytes, file of {size})")
    try:
        header = json.loads(f.read(length))
    except ValueError:
        header = None
    if not isinstance(header, dict):
        raise ValueError("has an unreadable header (not safetensors, or damaged)")
    return length, header
