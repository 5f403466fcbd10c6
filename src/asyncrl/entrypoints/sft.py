"""`sft`: Supervised fine-tuning on prompt/completion chat data (FSDP2)."""

from __future__ import annotations

from asyncrl.config.cli import fail, parse_or_exit
from asyncrl.config.sft import SFTConfig
from asyncrl.utils.logging import setup_logger

SUMMARY = "Supervised fine-tuning on prompt/completion chat data (FSDP2)."


def main(argv: list[str] | None = None) -> None:
    config = parse_or_exit(SFTConfig, "sft", SUMMARY, argv)
    setup_logger("sft", config.output_dir, config.log.level, config.log.file)
    fail("sft is not implemented yet (config parsing and --dry-run work)")


if __name__ == "__main__":
    main()
