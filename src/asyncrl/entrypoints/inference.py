"""`inference`: the OpenAI-compatible server (embedded engine by default, `--backend vllm` for vLLM)."""

from __future__ import annotations

import os

from asyncrl.config.inference import SERVER_ROLE_VAR, InferenceConfig
from asyncrl.entrypoints import entry
from asyncrl.transport.layout import RunLayout

SUMMARY = "OpenAI-compatible inference server with token ids, logprobs and /update_weights."


def run(config: InferenceConfig, layout: RunLayout) -> None:
    from asyncrl.inference import serve

    serve(config, layout)


def main(argv: list[str] | None = None) -> None:
    role = os.environ.get(SERVER_ROLE_VAR) or None
    entry(InferenceConfig, run, "inference", SUMMARY, argv, passthrough=True, component=role)


if __name__ == "__main__":
    main()
