"""Wire formats between processes: rollout batches (orchestrator -> trainer), weight dirs (trainer -> server)."""
