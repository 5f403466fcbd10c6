"""Export the sharded model as a HF weight dir (safetensors + config + tokenizer) for the inference server.

The full state dict is gathered to rank 0 (CPU), LoRA adapters are merged into their base weights,
tensors are cast back to the dtype of the checkpoint we loaded, a tied lm_head is dropped (HF re-ties
it on load), and the files are written through `transport.files.publish_dir` (temp dir, rename,
`STABLE` marker last), with each tensor's fingerprint in `fingerprint.json` (transport/fingerprint.py: the
server answers with those of what it loaded). Large models are sharded into several safetensors files plus an index.
A LoRA run also puts the adapter alone, in PEFT format, in each dir's `adapter/` (`export_weights(..., adapter=)`).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from asyncrl.core import failpoint
from asyncrl.trainer.lora import merge_lora_state_dict, peft_adapter, peft_config
from asyncrl.transport import experts, fingerprint
from asyncrl.transport.files import STABLE, publish_dir
from asyncrl.transport.layout import ADAPTER, step_of

MAX_SHARD_SIZE = "5GB"


def gather_full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Collective: every rank must call it. Rank 0 gets the full CPU state dict, the others an empty one."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def to_hf_state_dict(
    state: dict[str, torch.Tensor], hf_config, dtype: torch.dtype, lora_scale: float | None = None
) -> dict[str, torch.Tensor]:
    """Trainer state dict -> the key names and dtype a plain HF checkpoint of this model has (an MoE's experts
    one tensor each, `transport.experts`)."""
    if lora_scale is not None:
        state = merge_lora_state_dict(state, lora_scale)
    tied = getattr(hf_config, "tie_word_embeddings", False)
    out = {}
    for key, value in experts.split(state).items():
        if tied and key == "lm_head.weight":
            continue
        out[key] = value.detach().to(dtype).contiguous()
    return out


def write_hf_dir(path: Path, state: dict[str, torch.Tensor], hf_config, tokenizer, dtype: torch.dtype) -> None:
    """Write safetensors (sharded past MAX_SHARD_SIZE), config.json and the tokenizer files."""
    from huggingface_hub import split_torch_state_dict_into_shards

    split = split_torch_state_dict_into_shards(state, max_shard_size=MAX_SHARD_SIZE)
    for filename, keys in split.filename_to_tensors.items():
        save_file({k: state[k] for k in keys}, str(path / filename), metadata={"format": "pt"})
    if split.is_sharded:
        index = {
            "metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
            "weight_map": split.tensor_to_filename,
        }
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = copy.deepcopy(hf_config)
    config.dtype = dtype
    config.save_pretrained(path)
    tokenizer.save_pretrained(path)


def link_dir(src: Path, dst: Path) -> None:
    """Fill `dst` with hard links to `src`'s files and subdirs' files (copies where linking fails); the marker
    is skipped."""
    for f in src.iterdir():
        if f.is_dir():
            (dst / f.name).mkdir()
            link_dir(f, dst / f.name)
        if f.name == STABLE or not f.is_file():
            continue
        try:
            os.link(f, dst / f.name)
        except OSError:
            shutil.copy2(f, dst / f.name)


def export_weights(
    model: nn.Module,
    dests: list[Path],
    hf_config,
    tokenizer,
    dtype: torch.dtype,
    lora_scale: float | None,
    is_main: bool,
    generation_config=None,
    adapter: dict | None = None,
) -> None:
    """Collective: gather the weights and (rank 0) publish them to every dir in `dests`, marker last;
    `adapter` (LoRA settings for `peft_adapter`): the adapter alone too, in PEFT format, in `<dir>/adapter`."""
    state = gather_full_state_dict(model)
    if not is_main or not dests:
        return
    peft = peft_adapter(state, **adapter) if adapter is not None else None
    hf_state = to_hf_state_dict(state, hf_config, dtype, lora_scale)
    del state

    def write(tmp: Path) -> None:
        write_hf_dir(tmp, hf_state, hf_config, tokenizer, dtype)
        fingerprint.write(tmp, fingerprint.of_tensors(hf_state))
        if generation_config is not None:
            generation_config.save_pretrained(tmp)
        if peft is not None:
            write_adapter(tmp / ADAPTER, *peft, dtype)
        failpoint.reached("trainer.weights", step_of(dests[0].name))

    _publish(dests, write)


def export_adapter(
    params: list[tuple[str, torch.Tensor]], dests: list[Path], adapter: dict, dtype: torch.dtype, is_main: bool
) -> None:
    """Collective: a multi-run trainer's run publishes its adapter alone (`(PEFT key, parameter)` pairs, each
    gathered whole) as `<dir>/adapter` of every dir in `dests`, marker last; the dirs hold no base weights."""
    tensors = {key: p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for key, p in params}
    if not is_main or not dests:
        return
    tensors = {k: v.detach().cpu() for k, v in tensors.items()}
    config = peft_config(tensors, **adapter)

    def write(tmp: Path) -> None:
        write_adapter(tmp / ADAPTER, config, tensors, dtype)
        failpoint.reached("trainer.weights", step_of(dests[0].name))

    _publish(dests, write)


def _publish(dests: list[Path], write) -> None:
    """`write` fills the first dir; the others hard-link its files (each published whole, marker last)."""
    publish_dir(dests[0], write)
    for other in dests[1:]:
        publish_dir(other, lambda tmp: link_dir(dests[0], tmp))


def write_adapter(path: Path, config: dict, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """A PEFT adapter dir: adapter_config.json + adapter_model.safetensors (in the export dtype)."""
    path.mkdir()
    tensors = {k: v.to(dtype) for k, v in tensors.items()}
    save_file(tensors, str(path / "adapter_model.safetensors"))
    fingerprint.write(path, fingerprint.of_tensors(tensors))
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2))
