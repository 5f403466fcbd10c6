"""`rl --bench`: THE JOB (job), its cached SFT warm-up (warmup), held-out accuracy (heldout), the numbers (summary)."""
