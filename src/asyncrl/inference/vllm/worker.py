"""vLLM worker extension (`--worker-extension-cls`): in-place weight reload that keeps tied weights right.

Runs inside each vLLM worker process; the API server calls it through `collective_rpc`.
"""

import torch


class WeightReloadExtension:
    """Mixed into vLLM's worker class, so `self` is the worker (`reload_weights`, `model_runner`)."""

    def asyncrl_load_weights(self, weights_path: str) -> None:
        """Reload all weights from a HF safetensors dir, in place (tensors keep their storage)."""
        self.reload_weights(weights_path=weights_path)
        self._asyncrl_refresh_tied_layers()

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
