"""`orchestrator`: rollouts from verifiers environments -> advantages -> packed batches for the trainer."""

from __future__ import annotations

from asyncrl.config.cli import parse_or_exit, run_guarded
from asyncrl.config.orchestrator import OrchestratorConfig
from asyncrl.utils.logging import setup_logger

SUMMARY = "Orchestrator: gets rollouts from the inference server, scores them, writes training batches."


def main(argv: list[str] | None = None) -> None:
    config = parse_or_exit(OrchestratorConfig, "orchestrator", SUMMARY, argv)
    setup_logger("orchestrator", config.output_dir, config.log.level, config.log.file)

    def run() -> None:
        from asyncrl.orchestrator.loop import run_orchestrator

        run_orchestrator(config)

    run_guarded(run)


if __name__ == "__main__":
    main()
