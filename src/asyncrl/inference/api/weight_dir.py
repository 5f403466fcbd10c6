"""What a HF safetensors weight dir holds, and whether it fits the served model, before anything is swapped.

Shared by both engines. Only file headers are read here (names, dtypes and shapes, no tensor data), with
plain reads (no memory map: a file another process rewrites meanwhile is an error, never a crash); every
problem (missing dir, no or unreadable shards, malformed index, other tensor names, shapes or kinds) is an
`InvalidRequest` naming the request field (`param`), so the server keeps serving its current weights.
Every file a weight dir names (index shards, symlinked files) must resolve inside that dir: 403 otherwise,
with one message whether or not the outside file exists.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from asyncrl.inference.api.errors import InvalidRequest
from asyncrl.transport.weights import read_header as safetensors_header

FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F4"}

Header = dict[str, tuple[str, tuple[int, ...]]]  # tensor name -> (safetensors dtype, shape)


def is_dir(path: str | Path) -> bool:
    """Whether `path` is a directory; False too for a path the OS cannot look up (a name too long, ...)."""
    try:
        return Path(path).is_dir()
    except (OSError, ValueError):
        return False


def one_line(text: object) -> str:
    """`text` on one line (library errors can span several)."""
    return " ".join(str(text).split())


def file_inside(directory: str | Path, name: str, param: str) -> Path:
    """`directory / name`, refused (403) unless it resolves inside `directory` (absolute, `..`, symlinks out).

    The answer never depends on whether the named file exists, so it tells nothing about the filesystem.
    """
    root = Path(directory).resolve()
    path = Path(directory) / name
    if Path(name).is_absolute() or not path.resolve().is_relative_to(root):
        raise InvalidRequest(
            f"{param} '{directory}' names the file '{name}', which is not inside it: every shard and adapter "
            "file must lie in the dir itself (no absolute paths, '..' or symlinks out of it)",
            param=param,
            status=403,
        )
    return path


def safetensors_files(path: str | Path, param: str = "weight_dir", confine: bool = True) -> list[Path]:
    """The safetensors files of a HF weight dir (the shards of its index if it has one), each inside it.

    `confine=False` only for the server's own checkpoint (a HF cache snapshot's files link to its blobs).
    """
    root = Path(path)
    if not is_dir(root):
        raise InvalidRequest(f"{param} '{path}' does not exist or is not a directory", param=param)
    index = root / "model.safetensors.index.json"
    named = (lambda n: file_inside(path, n, param)) if confine else (lambda n: root / n)
    if index.is_file():
        return _indexed_shards(path, index, param, named)
    names = sorted(p.name for p in root.glob("*.safetensors") if not p.name.startswith("adapter_"))
    if not names:
        raise InvalidRequest(f"{param} '{path}' contains no *.safetensors files", param=param)
    return [named(n) for n in names]


def index_shards(index: Path, param: str) -> list[str]:
    """The shard file names a `model.safetensors.index.json` lists (its `weight_map` values), checked."""
    try:
        data = json.loads(index.read_bytes())
    except (OSError, ValueError) as e:
        raise InvalidRequest(f"{index} is not a valid safetensors index ({one_line(e)})", param=param) from e
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise InvalidRequest(
            f"{index}: weight_map must be a non-empty JSON object of tensor name -> shard file name, "
            f"got {type(weight_map if isinstance(data, dict) else data).__name__}",
            param=param,
        )
    for tensor, shard in weight_map.items():
        if not isinstance(shard, str) or not shard:
            raise InvalidRequest(
                f"{index}: weight_map['{tensor}'] must be a shard file name (a string), got {one_line(shard)[:60]}",
                param=param,
            )
    return sorted(set(weight_map.values()))


def _indexed_shards(path: str | Path, index: Path, param: str, named: Callable[[str], Path]) -> list[Path]:
    named(index.name)
    files = [named(s) for s in index_shards(index, param)]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise InvalidRequest(f"{param} '{path}' lacks shards listed in its index: {missing[:3]}", param=param)
    return files


def read_header(f: Path, param: str) -> Header:
    """Tensor name -> (dtype, shape) of one safetensors file, from its header (plain reads, no tensor data)."""
    try:
        with open(f, "rb") as fh:
            _, raw = safetensors_header(fh, os.fstat(fh.fileno()).st_size)
        header = {k: (v["dtype"], tuple(int(d) for d in v["shape"])) for k, v in raw.items() if k != "__metadata__"}
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:  # truncated, not safetensors, ...
        raise InvalidRequest(f"cannot read {f}: not a complete safetensors file ({one_line(e)})", param=param) from e
    return header


def checkpoint_header(path: str | Path, param: str = "weight_dir", confine: bool = True) -> Header:
    """Tensor name -> (dtype, shape) of a HF safetensors dir, read from the file headers."""
    header: Header = {}
    for f in safetensors_files(path, param=param, confine=confine):
        header.update(read_header(f, param))
    return header


def check_weight_dir(weight_dir: str | Path, expected: Header | None) -> None:
    """Raise InvalidRequest unless `weight_dir` holds exactly the tensors (names, shapes, float or not) of
    `expected`; None: the base checkpoint is not on local disk, so only readability is checked."""
    header = checkpoint_header(weight_dir)
    if expected is None:
        return
    shapes = {k: s for k, (_, s) in header.items()}
    unexpected = sorted(set(shapes) - set(expected))
    missing = sorted(set(expected) - set(shapes))
    wrong = [
        f"{k}: {shapes[k]} vs {expected[k][1]}" for k in sorted(shapes) if k in expected and shapes[k] != expected[k][1]
    ]
    kind = [f"{k}: {header[k][0]}" for k in sorted(header) if k in expected and not_float(header[k][0], expected[k][0])]
    for what, items in (
        ("unexpected tensors", unexpected),
        ("missing tensors", missing),
        ("shape mismatch", wrong),
        ("integer or bool tensors where the model has floating point ones", kind),
    ):
        if items:
            more = " ..." if len(items) > 3 else ""
            raise InvalidRequest(
                f"weights in '{weight_dir}' do not match the served model: {what} {items[:3]}{more}",
                param="weight_dir",
            )


def not_float(dtype: str, expected: str) -> bool:
    """A tensor of `dtype` stands where the model has a floating point one (`expected`)."""
    return expected in FLOAT_DTYPES and dtype not in FLOAT_DTYPES
