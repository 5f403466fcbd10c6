"""`synthesize`: Roll out environments and write an SFT dataset."""

from __future__ import annotations

from asyncrl.config.cli import fail, parse_or_exit
from asyncrl.config.synthesize import SynthesizeConfig
from asyncrl.utils.logging import setup_logger

SUMMARY = "Roll out environments and write an SFT dataset."


def main(argv: list[str] | None = None) -> None:
    config = parse_or_exit(SynthesizeConfig, "synthesize", SUMMARY, argv)
    setup_logger("synthesize", config.output_dir, config.log.level, config.log.file)
    fail("synthesize is not implemented yet (config parsing and --dry-run work)")


if __name__ == "__main__":
    main()
