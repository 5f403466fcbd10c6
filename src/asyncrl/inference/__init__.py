"""The `inference` component: an OpenAI-compatible server (token ids + logprobs) over a pluggable engine.

`run_server(config)` serves until interrupted; `create_app(backend, config)` builds the ASGI app.
The embedded torch+transformers engine is the default backend; importing this package loads neither
torch nor vllm.
"""

from asyncrl.inference.api.app import create_app, run_server

__all__ = ["create_app", "run_server"]
