"""`orchestrator`: rollouts from verifiers environments -> advantages -> packed batches for the trainer."""

from __future__ import annotations

from asyncrl.config.orchestrator import OrchestratorConfig
from asyncrl.entrypoints import entry
from asyncrl.transport.layout import RunLayout

SUMMARY = "Orchestrator: gets rollouts from the inference server, scores them, writes training batches."


def run(config: OrchestratorConfig, layout: RunLayout) -> None:
    from asyncrl.orchestrator import run_orchestrator

    run_orchestrator(config, layout)


def main(argv: list[str] | None = None) -> None:
    entry(OrchestratorConfig, run, "orchestrator", SUMMARY, argv, joins=True)


if __name__ == "__main__":
    main()
