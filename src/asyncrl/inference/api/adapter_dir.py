"""What a PEFT LoRA adapter dir must hold before either engine loads it: a sane config and 2-D float tensors.

Shared by both engines, checked before the engine sees the dir: `adapter_config.json` (a JSON object whose
`r`, `lora_alpha`, `alpha_pattern`, `rank_pattern` and `target_modules` have the types and ranges PEFT
gives them) and `adapter_model.safetensors` (every tensor a finite floating point matrix). Both
files must lie inside the dir (403 otherwise, as for weight dirs). Each problem is one `InvalidRequest`
(400, param `lora_path`) naming the field and what is wrong with it.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from asyncrl.inference.api.errors import InvalidRequest
from asyncrl.inference.api.weight_dir import FLOAT_DTYPES, file_inside, one_line, read_header

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"


def _fail(msg: str) -> InvalidRequest:
    return InvalidRequest(msg, param="lora_path")


def check_adapter_dir(path: str | Path) -> None:
    """Raise InvalidRequest unless `path` holds a loadable LoRA adapter config (and float matrix weights)."""
    cfg_file = file_inside(path, CONFIG, "lora_path")
    if not cfg_file.is_file():
        raise _fail(f"lora_path '{path}' has no {CONFIG} (expected a PEFT adapter dir)")
    check_adapter_config(read_config(cfg_file), cfg_file)
    weights = file_inside(path, WEIGHTS, "lora_path")
    if weights.is_file():  # vLLM also reads .bin adapters; the engine says when none is there
        check_adapter_header(weights)
        check_adapter_values(weights)


def read_config(cfg_file: Path) -> dict:
    try:
        cfg = json.loads(cfg_file.read_bytes())
    except (OSError, ValueError) as e:
        raise _fail(f"{cfg_file} is not valid JSON ({one_line(e)})") from e
    if not isinstance(cfg, dict):
        raise _fail(f"{cfg_file} must hold a JSON object (a PEFT adapter config), not {type(cfg).__name__}")
    return cfg


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_adapter_config(cfg: dict, where: Path) -> None:
    """The fields both engines read, with PEFT's types: r > 0, finite alphas, pattern dicts, valid regexes."""
    r = cfg.get("r", 8)
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise _fail(f"{where}: r must be a positive integer (the LoRA rank), got {one_line(json.dumps(r))[:60]}")
    alpha = cfg.get("lora_alpha", r)
    if not _number(alpha):
        raise _fail(f"{where}: lora_alpha must be a finite number, got {one_line(json.dumps(alpha))[:60]}")
    for field, want_int in (("alpha_pattern", False), ("rank_pattern", True)):
        _check_pattern(cfg.get(field), field, want_int, where)
    _check_targets(cfg.get("target_modules"), where)


def _check_pattern(value: object, field: str, want_int: bool, where: Path) -> None:
    if value is None:
        return
    if not isinstance(value, dict):
        raise _fail(f"{where}: {field} must be a JSON object of module pattern -> value, got {type(value).__name__}")
    for pattern, v in value.items():
        _compile(pattern, field, where)
        ok = isinstance(v, int) and not isinstance(v, bool) and v >= 1 if want_int else _number(v)
        if not ok:
            need = "a positive integer" if want_int else "a finite number"
            raise _fail(f"{where}: {field}['{pattern}'] must be {need}, got {one_line(json.dumps(v))[:60]}")


def _check_targets(value: object, where: Path) -> None:
    if value is None:
        return
    if isinstance(value, str):
        _compile(value, "target_modules", where)  # PEFT: one string is a regex over module names
        return
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _fail(f"{where}: target_modules must be a list of module names or one regex string")


def _compile(pattern: object, field: str, where: Path) -> None:
    try:
        re.compile(str(pattern))
    except re.error as e:
        raise _fail(f"{where}: {field} has an invalid regex {str(pattern)[:60]!r} ({e})") from e


def check_adapter_values(weights: Path) -> None:
    """No NaN or inf in the adapter (read whole: adapters are small; torch is imported here only)."""
    from asyncrl.inference.api.tensor_values import check_values, read_file

    check_values(read_file(weights, "lora_path"), f"adapter '{weights.parent}'", "lora_path")


def check_adapter_header(weights: Path) -> None:
    """Every adapter tensor is a floating point matrix (LoRA A and B), read from the header only."""
    for name, (dtype, shape) in read_header(weights, "lora_path").items():
        if dtype not in FLOAT_DTYPES or len(shape) != 2 or 0 in shape:
            raise _fail(
                f"{weights}: tensor '{name}' is {dtype} of shape {list(shape)}; LoRA weights are "
                "floating point matrices (2-D, no empty dimension)"
            )
