"""`trainer`: the FSDP2 RL trainer (`torchrun --nproc-per-node N -m asyncrl.entrypoints.trainer ...`)."""

from __future__ import annotations

from asyncrl.config.trainer import TrainerConfig
from asyncrl.entrypoints import entry
from asyncrl.transport.layout import RunLayout

SUMMARY = "RL trainer: reads packed rollout batches, updates the policy with FSDP2, publishes weights."


def run(config: TrainerConfig, layout: RunLayout) -> None:
    from asyncrl.trainer.rl import train

    train(config, layout)


def main(argv: list[str] | None = None) -> None:
    entry(TrainerConfig, run, "trainer", SUMMARY, argv, ranked=True, joins=True)


if __name__ == "__main__":
    main()
