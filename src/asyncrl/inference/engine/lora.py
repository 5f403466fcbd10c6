"""LoRA adapters for the embedded engine: read PEFT adapter dirs, apply them per row with forward hooks.

No weights are merged: each targeted Linear gets a hook that adds scale * (x A^T) B^T to the rows
(flattened tokens) whose request named that adapter, so base-model and adapter requests share one
batched forward. PEFT format: adapter_config.json + adapter_model.safetensors with keys like
`base_model.model.<module>.lora_A.weight` ([r, in]) and `...lora_B.weight` ([out, r]).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from asyncrl.inference.api.errors import InvalidRequest
from asyncrl.inference.api.tensor_values import check_values
from asyncrl.inference.api.weight_dir import file_inside
from asyncrl.inference.engine.weight_loading import read_state_dict
from asyncrl.transport import fingerprint

_PREFIX = "base_model.model."
_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")


@dataclass
class LoraAdapter:
    name: str
    weights: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = field(default_factory=dict)  # module -> A, B, scale
    fingerprints: dict[str, str] = field(default_factory=dict)  # file key -> the fingerprint of the tensor held


def _fail(msg: str) -> InvalidRequest:
    return InvalidRequest(msg, param="lora_path")


def read_adapter(name: str, path: str, model: torch.nn.Module) -> LoraAdapter:
    """Load and validate a PEFT LoRA adapter dir for `model` (tensors on the model's device/dtype)."""
    root = Path(path)
    cfg_file = file_inside(root, "adapter_config.json", "lora_path")
    if not cfg_file.is_file():
        raise _fail(f"lora_path '{path}' has no adapter_config.json (expected a PEFT adapter dir)")
    try:
        cfg = json.loads(cfg_file.read_text())
    except ValueError as e:
        raise _fail(f"{cfg_file} is not valid JSON ({e})") from e
    if not isinstance(cfg, dict):
        raise _fail(f"{cfg_file} must hold a JSON object (a PEFT adapter config), not {type(cfg).__name__}")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise _fail(f"adapter type {cfg.get('peft_type')} is not supported (only LORA)")
    for flag in ("use_dora", "fan_in_fan_out"):
        if cfg.get(flag):
            raise _fail(f"LoRA adapters with {flag}=true are not supported by the embedded engine")
    if cfg.get("bias", "none") != "none":
        raise _fail("LoRA adapters with trained biases are not supported (bias must be 'none')")
    weight_file = file_inside(root, "adapter_model.safetensors", "lora_path")
    if not weight_file.is_file():
        raise _fail(f"lora_path '{path}' has no adapter_model.safetensors")
    tensors = read_state_dict([weight_file], param="lora_path")
    check_values(tensors, f"adapter '{path}'", "lora_path")

    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key.removeprefix(_PREFIX))
        if m is None:
            raise _fail(f"adapter tensor '{key}' is not a LoRA A/B matrix (modules_to_save/embeddings unsupported)")
        pairs.setdefault(m["module"], {})[m["ab"]] = t
    if not pairs:
        raise _fail(f"adapter '{path}' contains no LoRA weights")

    modules = dict(model.named_modules())
    param = next(model.parameters())
    alpha = float(cfg.get("lora_alpha", cfg.get("r", 8)))
    alpha_pattern: dict[str, float] = cfg.get("alpha_pattern") or {}
    adapter = LoraAdapter(name)
    for mod_name, ab in pairs.items():
        module = modules.get(mod_name)
        if module is None or not isinstance(module, torch.nn.Linear):
            raise _fail(f"adapter targets '{mod_name}', which is not a Linear layer of the served model")
        if set(ab) != {"A", "B"}:
            raise _fail(f"adapter module '{mod_name}' lacks its lora_{'B' if 'A' in ab else 'A'} matrix")
        a, b = ab["A"], ab["B"]
        rank = a.shape[0]
        if a.shape != (rank, module.in_features) or b.shape != (module.out_features, rank):
            raise _fail(
                f"adapter shapes for '{mod_name}' ({tuple(a.shape)}, {tuple(b.shape)}) do not fit "
                f"Linear({module.in_features}, {module.out_features})"
            )
        mod_alpha = alpha
        for pattern, value in alpha_pattern.items():
            if re.match(rf"(.*\.)?{pattern}$", mod_name):
                mod_alpha = float(value)
        scale = mod_alpha / (math.sqrt(rank) if cfg.get("use_rslora") else rank)
        adapter.weights[mod_name] = (a.to(param.device, param.dtype), b.to(param.device, param.dtype), scale)
    adapter.fingerprints = _held_fingerprints(adapter, tensors)
    return adapter


def _held_fingerprints(adapter: LoraAdapter, tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """The fingerprint of each of the file's tensors as the adapter holds it (`fingerprint.of_held`)."""
    out = {}
    for key, t in tensors.items():
        m = _KEY.match(key.removeprefix(_PREFIX))
        a, b, _ = adapter.weights[m["module"]]
        out[key] = fingerprint.of_held(a if m["ab"] == "A" else b, t)
    return out


class LoraManager:
    """Owns the adapters and the forward hooks; `set_rows` says which flattened rows use which adapter."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.adapters: dict[str, LoraAdapter] = {}
        self._hooked: set[str] = set()
        self._active: list[tuple[LoraAdapter, torch.Tensor | None]] = []  # None index: every row

    def add(self, adapter: LoraAdapter) -> None:
        modules = dict(self.model.named_modules())
        for mod_name in adapter.weights:
            if mod_name not in self._hooked:
                modules[mod_name].register_forward_hook(self._make_hook(mod_name))
                self._hooked.add(mod_name)
        self.adapters[adapter.name] = adapter

    def remove(self, name: str) -> None:
        """Drop adapter `name` (its modules' hooks stay: they skip what no active adapter names)."""
        del self.adapters[name]

    def set_rows(self, names: list[str | None], device: torch.device) -> None:
        """Adapter name (or None) per flattened input row of the next forward."""
        self._active = []
        if not self.adapters:
            return
        groups: dict[str, list[int]] = {}
        for i, n in enumerate(names):
            if n is not None:
                groups.setdefault(n, []).append(i)
        for n, rows in groups.items():
            index = None if len(rows) == len(names) else torch.tensor(rows, device=device)
            self._active.append((self.adapters[n], index))

    def _make_hook(self, mod_name: str):
        def hook(module, args, output):
            if not self._active:
                return output
            x = args[0].reshape(-1, args[0].shape[-1])
            out = output.view(-1, output.shape[-1])
            for adapter, index in self._active:
                w = adapter.weights.get(mod_name)
                if w is None:
                    continue
                a, b, scale = w
                if index is None:
                    out.add_((x @ a.t()) @ b.t(), alpha=scale)
                else:
                    out.index_add_(0, index, (x[index] @ a.t()) @ b.t(), alpha=scale)
            return output

        return hook
