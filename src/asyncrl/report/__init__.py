"""Looking at a run without W&B: `asyncrl status RUN_DIR` (status.py)."""
