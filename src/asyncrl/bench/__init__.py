"""The bench job (`rl --bench`, settings in `config.bench`): its cached SFT warm-up (warmup), held-out accuracy
(heldout), the run (run), the numbers (summary).

Words ("bench" says several things; the flags keep PRIME-RL's names, the code says which one it means):
- the bench job: `rl --bench`, the run compared with TRL's GRPOTrainer (benchmarks/trl_grpo.py): this package,
  `run.run_bench_job`;
- the trainers' throughput mode: `trainer --bench` / `sft --bench` (tokens/s, MFU on `FakeDataConfig` data):
  `trainer.perf.throughput_summary`, `trainer.session.print_throughput`;
- the orchestrator's throughput mode: `orchestrator --bench` (rollouts/s, tokens/s against a running server);
- the held-out evaluation: `heldout`, which the bench job and benchmarks/ scripts score with (not `eval`);
- benchmark scripts: benchmarks/ (results in docs/benchmarks.md); eval's `--benchmarks` is PRIME-RL's
  spelling of `--environment-ids`.
"""
