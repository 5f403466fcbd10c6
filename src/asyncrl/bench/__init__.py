"""The bench job (`rl --bench`, settings in `config.bench`): its cached SFT warm-up (warmup), held-out accuracy
(heldout), the run (run), the numbers (summary).

Words: the bench job is `rl --bench`, the run compared with TRL's GRPOTrainer (benchmarks/trl_grpo.py);
`trainer --bench`, `sft --bench` and `orchestrator --bench` are one component's benchmark mode; benchmarks/
holds benchmark scripts.
"""
