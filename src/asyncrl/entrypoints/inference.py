"""`inference`: the OpenAI-compatible server (embedded engine by default, `--backend vllm` for vLLM)."""

from __future__ import annotations

from asyncrl.config.cli import parse_or_exit, run_guarded
from asyncrl.config.inference import InferenceConfig
from asyncrl.utils.logging import setup_logger

SUMMARY = "OpenAI-compatible inference server with token ids, logprobs and /update_weights."


def run(config: InferenceConfig) -> None:
    from asyncrl.inference import serve

    serve(config)


def main(argv: list[str] | None = None) -> None:
    config = parse_or_exit(InferenceConfig, "inference", SUMMARY, argv, passthrough=True)
    setup_logger("inference", config.output_dir, config.log.level, config.log.file)
    run_guarded(lambda: run(config))


if __name__ == "__main__":
    main()
