"""FSDP2 trainers. `asyncrl.trainer.rl.train(config)` is the RL loop.

model/optim/ckpt/weights/perf are shared with SFT.
"""
