"""The `inference` component: an OpenAI-compatible server (token ids + logprobs) with RL training routes.

`serve(config, layout)` picks the engine (embedded torch engine or vLLM) and serves until interrupted.
Packages: `api` (the HTTP API, engine-agnostic), `engine` (the embedded engine), `vllm` (vLLM's server
with the API mounted on it). Importing this package loads neither torch nor vllm, and nothing in it
imports the orchestrator or the trainer.
"""

from asyncrl.inference.serving import serve

__all__ = ["serve"]
