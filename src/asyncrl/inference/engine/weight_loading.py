"""Load a HF safetensors weight dir into the embedded engine's live model, validated before anything is swapped.

Everything that can be wrong with a weight dir (missing, empty, other architecture, other shapes, integer
tensors, NaN or inf values) is found before the swap and raised as `InvalidRequest`, so the model keeps
serving its current weights. Tied parameters count as present when any of their aliases is. The checked
tensors are converted off the engine thread (`staged`) and swapped in as the parameters themselves between
two decode steps (`swap_in`): a running request waits for pointer swaps, not for a copy of the model.

Files are read with plain reads into memory, never memory-mapped (api/tensor_values.py): a file another
process truncates or rewrites while we read it is then an error (409 when we saw it change), not a SIGBUS
that kills the server.
"""

from __future__ import annotations

from pathlib import Path

import torch

from asyncrl.inference.api.errors import InvalidRequest
from asyncrl.inference.api.tensor_values import check_values, read_file
from asyncrl.inference.api.weight_dir import safetensors_files
from asyncrl.transport import experts, fingerprint


def read_state_dict(files: list[Path], param: str = "weight_dir") -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(read_file(f, param))
    return tensors


def load_matching_weights(path: str | Path, model: torch.nn.Module, confine: bool = True) -> dict[str, torch.Tensor]:
    """Tensors of `path` keyed like `model.state_dict()`, checked complete and shape-compatible.

    `confine=False` only for the server's own checkpoint (a HF cache snapshot's files link to its blobs).

    Tied parameters (e.g. lm_head sharing the embedding) count as present when any alias is.
    """
    tensors = experts.fuse(read_state_dict(safetensors_files(path, confine=confine)))  # an MoE's: as held
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
    check_values(
        {k: v for k, v in tensors.items() if state[k].is_floating_point()}, f"weights in '{path}'", "weight_dir"
    )
    return tensors


def loaded_fingerprints(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """The fingerprint of each of `tensors`' names as the model now holds it (`fingerprint.of_held`); a fused MoE
    parameter's under the checkpoint's names, one per expert and projection (`transport.experts`)."""
    state, out = model.state_dict(), {}
    for name, t in tensors.items():
        held, read = experts.split({name: state[name]}), experts.split({name: t})
        out.update({key: fingerprint.of_held(value, read[key]) for key, value in held.items()})
    return out


def staged(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Validated tensors as tensors of their own in the dtype and on the device of the model's (the slow part of
    an update: run it off the engine thread, then `swap_in`)."""
    state = model.state_dict()
    return {name: t.to(state[name].device, state[name].dtype).contiguous() for name, t in tensors.items()}


@torch.no_grad()
def swap_in(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Make `staged` tensors the model's parameters/buffers by name: a pointer swap each (microseconds), so a
    step between two decode steps; a parameter tied to others (lm_head to the embedding) is one object."""
    for name, t in tensors.items():
        try:
            target = model.get_parameter(name)
        except AttributeError:
            target = model.get_buffer(name)
        target.data = t
