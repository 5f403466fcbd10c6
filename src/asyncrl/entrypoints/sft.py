"""`sft`: supervised fine-tuning on prompt/completion chat data.

FSDP2; `torchrun --nproc-per-node N` for several ranks.
"""

from __future__ import annotations

from asyncrl.config.sft import SFTConfig
from asyncrl.entrypoints import entry
from asyncrl.transport.layout import RunLayout

SUMMARY = "Supervised fine-tuning on prompt/completion chat data (FSDP2)."


def run(config: SFTConfig, layout: RunLayout) -> None:
    from asyncrl.trainer.sft import train_sft

    train_sft(config, layout)


def reports(config: SFTConfig, layout: RunLayout) -> list[RunLayout]:
    return [layout] if config.report and not config.bench else []


def main(argv: list[str] | None = None) -> None:
    entry(SFTConfig, run, "sft", SUMMARY, argv, ranked=True, reports=reports, joins=True)


if __name__ == "__main__":
    main()
