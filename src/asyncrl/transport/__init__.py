"""Wire formats between processes: the run directory (`layout`), rollout batches of packed rows (`batch`, `row`;
orchestrator -> trainer), atomically published dirs (`files`; weights, trainer -> server)."""
