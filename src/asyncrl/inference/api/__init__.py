"""The HTTP API, for any engine: app factory, routes, auth, the one error body, request schemas.

- app.py: `create_app` (the embedded server's app) and `install_api` (mounts the API on any app, vLLM's too)
- training.py: /update_weights, /reload_weights, /load_lora_adapter, against a `TrainingEngine`
- completions.py, tokens.py: the OpenAI and token routes, against a full `Backend`
- backend.py: what the routes ask of an engine; deps.py: per-app state read through `Depends`
- errors.py: `InvalidRequest` and the one error body; auth.py: bearer auth
- schemas.py: request bodies; chat.py: chat templating and output parsing
- limits.py: body size, valid Unicode and message count, checked before any route; cpu.py: the worker thread
  that templates, tokenizes and parses big bodies off the event loop
- http_server.py: uvicorn's h11 protocol with head/body deadlines and 431s, and the uvicorn options both engines use
- template_sandbox.py: chat templates sent in requests (--trust-request-chat-template), bounded in time and memory
- weight_dir.py: what a HF weight dir holds and whether it fits the served model (both engines check with it)

Importing this package loads neither torch nor vllm; import its modules directly.
"""
