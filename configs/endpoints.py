"""Named model endpoints for `eval`: `eval --model.name NAME` reaches NAME's server (PRIME-RL's configs/endpoints.py).

Each entry: "model" (the id the server serves), "url" (its OpenAI-compatible base URL) and "key" (the
environment variable holding the API key; a local server needs none). Pass another file with --endpoints-path.
"""

ENDPOINTS = {
    "Qwen/Qwen2.5-7B-Instruct": {
        "model": "Qwen/Qwen2.5-7B-Instruct",
        "url": "http://0.0.0.0:8007/v1",
        "key": "local",
    },
}
