"""The SFT trainer: `train_sft(config, layout)` fine-tunes on prompt/completion chat data."""

from asyncrl.trainer.sft.loop import train_sft

__all__ = ["train_sft"]
