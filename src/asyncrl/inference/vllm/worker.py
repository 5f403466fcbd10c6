"""vLLM worker extension (`--worker-extension-cls`): in-place weight reload that keeps tied weights right.

Runs inside each vLLM worker process; the API server calls it through `collective_rpc`.
"""

import torch


class WeightReloadExtension:
    """Mixed into vLLM's worker class, so `self` is the worker (`reload_weights`, `model_runner`)."""

    def asyncrl_load_weights(self, weights_path: str, fingerprints: bool = False) -> dict[str, str] | None:
        """Reload all weights from a HF safetensors dir, in place (tensors keep their storage); with `fingerprints`,
        return those of the dir's tensors as this worker reads them (transport/fingerprint.py)."""
        self.reload_weights(weights_path=weights_path)
        self._asyncrl_refresh_tied_layers()
        return _read_fingerprints(weights_path) if fingerprints else None

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
    from pathlib import Path

    from safetensors import safe_open

    from asyncrl.transport import fingerprint

    out: dict[str, str] = {}
    for file in sorted(Path(weights_path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            out.update({key: fingerprint.of_tensor(f.get_tensor(key)) for key in f.keys()})
    return out
