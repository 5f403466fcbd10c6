"""Fingerprints of published weights: what the trainer wrote, and what a server loaded, tensor by tensor.

A tensor's fingerprint is the first 16 hex digits of the SHA-256 of its dtype, shape and bytes, taken in the
dtype it was published in. A server that computes in another dtype answers for what it holds (`of_held`): the
published tensor's fingerprint if it holds exactly that tensor cast to its own dtype (float32 weights served in
float16 are that cast, not the same bytes), else the fingerprint of what it holds cast back to the published
dtype, which then names the tensor as changed. The trainer writes `fingerprint.json` into
each weight dir it publishes (and into its `adapter/`), before the dir's marker; a server answers
`/update_weights` and `/load_lora_adapter` with the fingerprints of what it loaded; `difference` names the
first tensor that differs.

Invariants: the same tensor values in the same dtype give the same fingerprint in every process; a dir
without `fingerprint.json` (published before fingerprints, or by another tool) is served unchecked.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

FILE = "fingerprint.json"


def of_tensor(tensor: Any, dtype: Any = None) -> str:
    """The fingerprint of a torch tensor (cast to `dtype` first when given)."""
    t = tensor.detach()
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    t = t.cpu().contiguous()
    digest = hashlib.sha256(f"{str(t.dtype).removeprefix('torch.')}{tuple(t.shape)}".encode())
    digest.update(t.reshape(-1).view(_uint8()).numpy())
    return digest.hexdigest()[:16]


def of_held(held: Any, read: Any) -> str:
    """What a server answers for a tensor it read as `read` (the published dtype) and holds as `held`."""
    faithful = held.shape == read.shape and bool((held == read.to(held.device, held.dtype)).all())
    return of_tensor(read if faithful else held, read.dtype)


def _uint8() -> Any:
    import torch

    return torch.uint8


def of_tensors(tensors: Mapping[str, Any], dtypes: Mapping[str, Any] | None = None) -> dict[str, str]:
    """Each tensor's fingerprint, by name (`dtypes`: the dtype each was published in)."""
    return {name: of_tensor(t, (dtypes or {}).get(name)) for name, t in sorted(tensors.items())}


def write(path: Path, fingerprints: Mapping[str, str]) -> None:
    """`fingerprint.json` in `path` (a dir being published: the publish makes it visible whole)."""
    (path / FILE).write_text(json.dumps(dict(fingerprints), indent=0, sort_keys=True))


def read(path: Path) -> dict[str, str] | None:
    """The fingerprints published in dir `path`, or None when it has none (or they are unreadable)."""
    try:
        data = json.loads((path / FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def mismatch(published_dir: Path, loaded: Mapping[str, str] | None) -> str | None:
    """What differs between the fingerprints published in `published_dir` and `loaded` (None: nothing, or
    nothing to compare: a dir published without them, an engine that gives none)."""
    published = read(published_dir)
    if published is None or loaded is None:
        return None
    return difference(published, loaded)


def difference(published: Mapping[str, str], loaded: Mapping[str, str]) -> str | None:
    """The first tensor whose loaded fingerprint differs from (or lacks) the published one, said in a phrase."""
    for name, expected in sorted(published.items()):
        got = loaded.get(name)
        if got != expected:
            return f"tensor {name} (published {expected}, loaded {got or 'nothing'})"
    return None
