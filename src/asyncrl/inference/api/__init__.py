"""The HTTP API: app factory, routes, auth, error bodies and request schemas, for any engine.

Importing this package loads neither torch nor vllm; import its modules (`api.app`, ...) directly.
"""
