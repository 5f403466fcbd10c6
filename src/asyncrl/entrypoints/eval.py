"""`eval`: Evaluate environments against a server, optionally over saved weight steps."""

from __future__ import annotations

from asyncrl.config.cli import fail, parse_or_exit
from asyncrl.config.eval import EvalConfig
from asyncrl.utils.logging import setup_logger

SUMMARY = "Evaluate environments against a server, optionally over saved weight steps."


def main(argv: list[str] | None = None) -> None:
    config = parse_or_exit(EvalConfig, "eval", SUMMARY, argv)
    setup_logger("eval", config.output_dir, config.log.level, config.log.file)
    fail("eval is not implemented yet (config parsing and --dry-run work)")


if __name__ == "__main__":
    main()
