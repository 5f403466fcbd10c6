"""Per-step metrics out of the trainer (rank 0): JSON lines in `{output_dir}/metrics/<name>.jsonl`, optional W&B."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from loguru import logger

from asyncrl.config.base import WandbConfig
from asyncrl.utils.errors import UserError


class MetricsSink:
    def __init__(self, output_dir: str | Path, name: str, wandb_cfg: WandbConfig | None, run_config: dict, enabled: bool):
        self.enabled, self.name = enabled, name
        self.path = Path(output_dir) / "metrics" / f"{name}.jsonl"
        self._wandb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if wandb_cfg is not None:
            try:
                import wandb
            except ImportError as e:
                raise UserError("W&B logging is on but wandb is not installed: pip install 'asyncrl[wandb]'") from e
            if wandb_cfg.offline:
                os.environ["WANDB_MODE"] = "offline"
            run_name = f"{wandb_cfg.name}-{name}" if wandb_cfg.name else None
            self._wandb = wandb.init(
                project=wandb_cfg.project, name=run_name, id=wandb_cfg.id, resume="allow" if wandb_cfg.id else None,
                config=run_config, dir=str(Path(output_dir)),
            )

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self._wandb is not None:
            self._wandb.log({f"{self.name}/{k}": v for k, v in metrics.items() if v is not None}, step=step)

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        logger.debug(f"metrics in {self.path}")
