"""The RL trainer: `train(config, layout)` turns the orchestrator's packed rollout batches into policy weights."""

from asyncrl.trainer.rl.loop import train

__all__ = ["train"]
