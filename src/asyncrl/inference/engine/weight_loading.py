"""Load a HF safetensors weight dir into the embedded engine's live model, validated before anything is swapped.

Everything that can be wrong with a weight dir (missing, empty, other architecture, other shapes) is
found before the copy and raised as `InvalidRequest`, so the model keeps serving its current weights.
Tied parameters count as present when any of their aliases is.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from asyncrl.inference.api.errors import InvalidRequest
from asyncrl.inference.api.weight_dir import safetensors_files


def read_state_dict(files: list[Path], param: str = "weight_dir") -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as fh:
                for key in fh.keys():
                    tensors[key] = fh.get_tensor(key)
        except Exception as e:  # corrupt / truncated file: the user's problem, not a server error
            raise InvalidRequest(f"cannot read {f}: {e}", param=param) from e
    return tensors


def load_matching_weights(path: str | Path, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Tensors of `path` keyed like `model.state_dict()`, checked complete and shape-compatible.

    Tied parameters (e.g. lm_head sharing the embedding) count as present when any alias is.
    """
    tensors = read_state_dict(safetensors_files(path))
    state = model.state_dict()
    unknown = sorted(set(tensors) - set(state))
    if unknown:
        raise InvalidRequest(
            f"weights in '{path}' do not match the served model: unexpected tensors {unknown[:5]}"
            f"{' ...' if len(unknown) > 5 else ''}",
            param="weight_dir",
        )
    by_storage: dict[int, list[str]] = {}
    for name, t in state.items():
        by_storage.setdefault(t.data_ptr(), []).append(name)
    missing = [name for name, t in state.items() if not any(alias in tensors for alias in by_storage[t.data_ptr()])]
    if missing:
        raise InvalidRequest(
            f"weights in '{path}' do not match the served model: missing tensors {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}",
            param="weight_dir",
        )
    bad = [f"{k}: {tuple(v.shape)} vs {tuple(state[k].shape)}" for k, v in tensors.items() if v.shape != state[k].shape]
    if bad:
        raise InvalidRequest(
            f"weights in '{path}' do not match the served model: shape mismatch {bad[:3]}", param="weight_dir"
        )
    return tensors


@torch.no_grad()
def copy_into(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy validated tensors into the model's parameters/buffers in place (dtype/device converted)."""
    state = model.state_dict()
    for name, t in tensors.items():
        state[name].copy_(t)
