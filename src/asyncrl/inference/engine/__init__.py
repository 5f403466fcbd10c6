"""The embedded engine: a HF causal LM served with continuous batching (torch + transformers).

`EmbeddedEngine` implements the API's `Backend`; the modules beside it are its parts (KV cache,
sequences, sampling, prefix cache, LoRA, weight loading). Importing this package loads torch.
"""

from asyncrl.inference.engine.engine import EmbeddedEngine

__all__ = ["EmbeddedEngine"]
