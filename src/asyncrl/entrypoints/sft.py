"""`sft`: supervised fine-tuning on prompt/completion chat data.

FSDP2; `torchrun --nproc-per-node N` for several ranks.
"""

from __future__ import annotations

import os

from asyncrl.config.cli import parse_or_exit, run_guarded
from asyncrl.config.sft import SFTConfig
from asyncrl.utils.logging import setup_rank_logger

SUMMARY = "Supervised fine-tuning on prompt/completion chat data (FSDP2)."


def main(argv: list[str] | None = None) -> None:
    config = parse_or_exit(SFTConfig, "sft", SUMMARY, argv)
    setup_rank_logger("sft", config.output_dir, config.log.level, config.log.file)

    def run() -> None:
        from asyncrl.trainer.sft import train_sft

        train_sft(config)

    try:
        run_guarded(run)
    finally:  # rank 0, after run_guarded: the run record has its exit by then
        if config.report and not config.bench and int(os.environ.get("RANK", "0")) == 0:
            from asyncrl.report.report import report_at_end

            report_at_end(config.output_dir)


if __name__ == "__main__":
    main()
