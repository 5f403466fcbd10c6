"""`synthesize`: Roll out environments and write an SFT dataset."""

from __future__ import annotations

from asyncrl.config.cli import parse_or_exit, run_guarded
from asyncrl.config.synthesize import SynthesizeConfig
from asyncrl.utils.logging import setup_logger

SUMMARY = "Roll out environments and write an SFT dataset."


def main(argv: list[str] | None = None) -> None:
    config = parse_or_exit(SynthesizeConfig, "synthesize", SUMMARY, argv)
    setup_logger("synthesize", config.output_dir, config.log.level, config.log.file)

    def run() -> None:
        from asyncrl.evaluation.synthesize import run_synthesize

        run_synthesize(config)

    run_guarded(run)


if __name__ == "__main__":
    main()
