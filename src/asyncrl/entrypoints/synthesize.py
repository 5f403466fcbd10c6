"""`synthesize`: Roll out environments and write an SFT dataset."""

from __future__ import annotations

from asyncrl.config.synthesize import SynthesizeConfig
from asyncrl.entrypoints import entry
from asyncrl.transport.layout import RunLayout

SUMMARY = "Roll out environments and write an SFT dataset."


def run(config: SynthesizeConfig, layout: RunLayout) -> None:
    from asyncrl.evaluation.synthesize import run_synthesize

    run_synthesize(config, layout)


def main(argv: list[str] | None = None) -> None:
    entry(SynthesizeConfig, run, "synthesize", SUMMARY, argv)


if __name__ == "__main__":
    main()
