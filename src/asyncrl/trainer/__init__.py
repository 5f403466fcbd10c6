"""FSDP2 trainers: `trainer.rl.train(config, layout)` (RL) and `trainer.sft.train_sft(config, layout)` (SFT).

Both are a loop (`rl/`, `sft/`: batches and forward/backward) run by one `session` (process group,
model, optimizer, schedule, checkpoints, metrics, weight export). The building blocks are shared:
`dist`, `model` (+ `lora`), `optim`, `ckpt`, `export`, `perf`; `loss` holds the RL losses and the
`loss.custom` interface.
"""
