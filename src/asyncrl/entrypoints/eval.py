"""`eval`: Evaluate environments against a server, optionally over saved weight steps."""

from __future__ import annotations

from asyncrl.config.eval import EvalConfig
from asyncrl.entrypoints import entry
from asyncrl.transport.layout import RunLayout

SUMMARY = "Evaluate environments against a server, optionally over saved weight steps."


def run(config: EvalConfig, layout: RunLayout) -> None:
    from asyncrl.evaluation.evaluate import run_eval

    run_eval(config, layout)


def reports(config: EvalConfig, layout: RunLayout) -> list[RunLayout]:
    return [layout] if config.report else []


def main(argv: list[str] | None = None) -> None:
    entry(EvalConfig, run, "eval", SUMMARY, argv, reports=reports)


if __name__ == "__main__":
    main()
