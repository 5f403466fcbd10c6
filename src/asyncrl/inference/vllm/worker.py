"""vLLM worker extension (`--worker-extension-cls`): in-place weight reload that keeps tied weights right.

Runs inside each vLLM worker process; the API server calls it through `collective_rpc`.
"""

from collections.abc import Iterator

import torch


class WeightReloadExtension:
    """Mixed into vLLM's worker class, so `self` is the worker (`reload_weights`, `model_runner`)."""

    def asyncrl_load_weights(self, weights_path: str, fingerprints: bool = False) -> dict[str, str] | None:
        """Reload all weights from a HF safetensors dir, in place (tensors keep their storage); with `fingerprints`,
        return those of the dir's tensors as this worker reads them (transport/fingerprint.py)."""
        self.reload_weights(weights_path=weights_path)
        self._asyncrl_refresh_tied_layers()
        return _read_fingerprints(weights_path) if fingerprints else None

    def asyncrl_adapter_fingerprints(self, lora_id: int, lora_path: str) -> dict[str, str]:
        """The fingerprint of each tensor of adapter dir `lora_path` as this worker holds adapter `lora_id`: the
        file tensor's own where the worker's copy is exactly what vLLM makes of it (the tensor in the adapter's
        dtype; B times its scaling), else that of the worker's copy (so it differs), or "absent"."""
        return _adapter_fingerprints(self.model_runner.lora_manager, lora_id, lora_path)

    def _asyncrl_refresh_tied_layers(self) -> None:
        # vLLM's reload re-processes only the layers a checkpoint tensor was loaded into. A layer that
        # shares its weight with another (lm_head tied to embed_tokens) gets none, so on CPU it keeps
        # the GEMM weights it prepacked at startup and keeps computing with the old values: redo its
        # post-load processing from the (already updated) shared tensor.
        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

        model = self.model_runner.get_model()
        owners: dict[int, list[torch.nn.Module]] = {}
        for module in model.modules():
            weight = module._parameters.get("weight")
            if weight is not None:
                owners.setdefault(id(weight), []).append(module)
        for modules in owners.values():
            if len(modules) < 2:
                continue
            for module in modules:
                quant_method = getattr(module, "quant_method", None)
                if isinstance(quant_method, UnquantizedEmbeddingMethod):
                    quant_method.process_weights_after_loading(module)


def _read_fingerprints(weights_path: str) -> dict[str, str]:
    from asyncrl.transport import fingerprint

    return {key: fingerprint.of_tensor(tensor) for key, tensor in _file_tensors(weights_path)}


def _adapter_fingerprints(manager, lora_id: int, lora_path: str) -> dict[str, str]:
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.utils import parse_fine_tuned_lora_name

    from asyncrl.transport import fingerprint

    adapters = manager._adapter_manager
    held = _held_pairs(adapters, lora_id)
    helper = PEFTHelper.from_local_dir(lora_path, manager.max_position_embeddings)
    mapper = getattr(adapters.model, "hf_to_vllm_mapper", None)
    mapper = mapper.get_rename_mapper() if mapper is not None else None  # renames only, as vLLM loads adapters
    out = {}
    for key, tensor in _file_tensors(lora_path):
        module, is_a = parse_fine_tuned_lora_name(key, mapper)
        live = held.get(module, (None, None))[0 if is_a else 1]
        if live is None:
            out[key] = "absent"
            continue
        expected = tensor.to(dtype=live.dtype).clone()
        if not is_a:  # vLLM merges the scaling into B, in B's dtype (LoRALayerWeights.optimize)
            _, scaling = helper.get_rank_and_scaling(parse_fine_tuned_lora_name(key)[0])
            expected *= scaling
        same = expected.shape == live.shape and torch.equal(expected, live.cpu())
        out[key] = fingerprint.of_tensor(tensor if same else live, tensor.dtype)
    return out


def _held_pairs(adapters, lora_id: int) -> dict[str, tuple]:
    """{module: (lora_a, lora_b)} of the adapter a worker's LoRA manager holds, packed modules (qkv_proj) split
    into the modules the adapter's files name; {} when it holds none by that id."""
    model = adapters.get_adapter(lora_id)
    out: dict[str, tuple] = {}
    for name, weights in (model.loras if model is not None else {}).items():
        if not weights.is_packed:
            out[name] = (weights.lora_a, weights.lora_b)
            continue
        for sub, a, b in zip(adapters.packed_modules.get(name, []), weights.lora_a, weights.lora_b, strict=False):
            if a is not None:
                out[sub] = (a, b)
    return out


def _file_tensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor in dir `path`'s safetensors files, read one at a time."""
    from pathlib import Path

    from safetensors import safe_open

    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)
