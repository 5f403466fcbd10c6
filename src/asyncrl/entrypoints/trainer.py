"""`trainer`: the FSDP2 RL trainer (`torchrun --nproc-per-node N -m asyncrl.entrypoints.trainer ...`)."""

from __future__ import annotations

from asyncrl.config.cli import parse_or_exit, run_guarded
from asyncrl.config.trainer import TrainerConfig
from asyncrl.utils.logging import setup_rank_logger

SUMMARY = "RL trainer: reads packed rollout batches, updates the policy with FSDP2, publishes weights."


def main(argv: list[str] | None = None) -> None:
    config = parse_or_exit(TrainerConfig, "trainer", SUMMARY, argv)
    setup_rank_logger("trainer", config.output_dir, config.log.level, config.log.file)

    def run() -> None:
        from asyncrl.trainer.rl import train

        train(config)

    run_guarded(run)


if __name__ == "__main__":
    main()
