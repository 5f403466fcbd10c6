"""Wire formats between processes: the run directory (`layout`), rollout batches (orchestrator -> trainer),
atomically published dirs (`files`; weights, trainer -> server)."""
