"""`eval`: Evaluate environments against a server, optionally over saved weight steps."""

from __future__ import annotations

from asyncrl.config.cli import parse_or_exit, run_guarded
from asyncrl.config.eval import EvalConfig
from asyncrl.utils.logging import setup_logger

SUMMARY = "Evaluate environments against a server, optionally over saved weight steps."


def main(argv: list[str] | None = None) -> None:
    config = parse_or_exit(EvalConfig, "eval", SUMMARY, argv)
    setup_logger("eval", config.output_dir, config.log.level, config.log.file)

    def run() -> None:
        from asyncrl.evaluation.evaluate import run_eval

        run_eval(config)

    try:
        run_guarded(run)
    finally:  # after run_guarded: the run record has its exit by then
        if config.report:
            from asyncrl.report.report import report_at_end

            report_at_end(config.output_dir)


if __name__ == "__main__":
    main()
