"""Tensor data of safetensors files, read safely, and checked to be weights (floating point, finite).

Shared by both engines (the embedded engine for whole weight dirs and adapters, the API for adapters).
A file is read with plain reads into memory, never memory-mapped: a file another process truncates or
rewrites meanwhile is a 400 (not a complete file) or a 409 (it changed while read), never a SIGBUS.
Imports torch: the API's other modules import this one only inside the functions that need it.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import load

from asyncrl.inference.api.errors import InvalidRequest
from asyncrl.inference.api.weight_dir import one_line


def read_bytes(f: Path, param: str) -> bytes:
    """The whole file, read plainly; 409 when its size or mtime changed while it was read."""
    try:
        before = os.stat(f)
        data = f.read_bytes()
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


def read_file(f: Path, param: str) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file, in memory (on the CPU)."""
    data = read_bytes(f, param)
    try:
        return load(data)
    except Exception as e:  # corrupt / truncated file: the user's problem, not a server error
        raise InvalidRequest(f"cannot read {f}: not a complete safetensors file ({one_line(e)})", param=param) from e


def check_values(tensors: dict[str, torch.Tensor], where: str, param: str) -> None:
    """Every tensor is floating point and finite (no NaN or inf); else 400 naming the first bad one."""
    for name, t in tensors.items():
        if not t.is_floating_point():
            raise InvalidRequest(f"{where}: tensor '{name}' is {t.dtype}, not floating point", param=param)
        if not bool(torch.isfinite(t).all()):
            raise InvalidRequest(f"{where}: tensor '{name}' holds NaN or inf values", param=param)
