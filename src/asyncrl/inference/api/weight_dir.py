"""What a HF safetensors weight dir holds, and whether it fits the served model, before anything is swapped.

Shared by both engines. Only file headers are read here (names and shapes, no tensor data); every
problem (missing dir, no or unreadable shards, other tensor names or shapes) is an `InvalidRequest`
naming the request field (`param`), so the server keeps serving its current weights.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open

from asyncrl.inference.api.errors import InvalidRequest


def is_dir(path: str | Path) -> bool:
    """Whether `path` is a directory; False too for a path the OS cannot look up (a name too long, ...)."""
    try:
        return Path(path).is_dir()
    except (OSError, ValueError):
        return False


def safetensors_files(path: str | Path, param: str = "weight_dir") -> list[Path]:
    """The safetensors files of a HF weight dir (the shards of its index if it has one)."""
    root = Path(path)
    if not is_dir(root):
        raise InvalidRequest(f"{param} '{path}' does not exist or is not a directory", param=param)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        return _indexed_shards(path, index, param)
    files = sorted(p for p in root.glob("*.safetensors") if not p.name.startswith("adapter_"))
    if not files:
        raise InvalidRequest(f"{param} '{path}' contains no *.safetensors files", param=param)
    return files


def _indexed_shards(path: str | Path, index: Path, param: str) -> list[Path]:
    try:
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (ValueError, KeyError) as e:
        raise InvalidRequest(f"{index} is not a valid safetensors index ({e})", param=param) from e
    files = [Path(path) / s for s in shards]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise InvalidRequest(f"{param} '{path}' lacks shards listed in its index: {missing[:3]}", param=param)
    return files


def checkpoint_shapes(path: str | Path, param: str = "weight_dir") -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of a HF safetensors dir, read from the file headers (no tensor data)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for f in safetensors_files(path, param=param):
        try:
            with safe_open(str(f), framework="pt") as fh:
                for key in fh.keys():
                    shapes[key] = tuple(fh.get_slice(key).get_shape())
        except Exception as e:  # truncated or not safetensors: the caller's mistake
            raise InvalidRequest(f"cannot read {f}: {e}", param=param) from e
    return shapes


def check_weight_dir(weight_dir: str | Path, expected: dict[str, tuple[int, ...]] | None) -> None:
    """Raise InvalidRequest unless `weight_dir` holds exactly the tensors (names, shapes) of `expected`."""
    shapes = checkpoint_shapes(weight_dir)
    if expected is None:  # base checkpoint not on local disk: only readability was checked
        return
    unexpected = sorted(set(shapes) - set(expected))
    missing = sorted(set(expected) - set(shapes))
    wrong = [f"{k}: {shapes[k]} vs {expected[k]}" for k in sorted(shapes) if k in expected and shapes[k] != expected[k]]
    for what, items in (("unexpected tensors", unexpected), ("missing tensors", missing), ("shape mismatch", wrong)):
        if items:
            more = " ..." if len(items) > 3 else ""
            raise InvalidRequest(
                f"weights in '{weight_dir}' do not match the served model: {what} {items[:3]}{more}",
                param="weight_dir",
            )
