"""The `rl` launcher: runs inference, orchestrator and trainer as child processes of one run.

`supervisor` writes each child's config, spawns and supervises them; `placement` decides which GPUs
(or CPU threads) each child gets; `tailer` turns the orchestrator's metrics into one console line per
step; `zygote` forks the Python children from one process that imported torch, transformers and verifiers
once, and `warm_ranks` has a torchrun it forked fork its ranks too. The launcher never imports the packages
of the processes it starts (only the zygote's own process does): it talks to them through their command
lines, their files (`transport.layout`) and the server's HTTP API.
"""
