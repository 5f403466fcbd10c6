"""Per-step metrics sink shared by every component: JSON lines in `{output_dir}/metrics/<name>.jsonl`, optional W&B.

Each row is `{"step": n, "time": unix_seconds, **metrics}`. W&B is imported only when configured; the run
name is used as given (the `rl` launcher already adds `-trainer` / `-orchestrator`).
Each step appears once: a process that (re)starts at step S first drops the rows of steps >= S that an
earlier attempt left (`restart_at`), since it is about to run those steps again.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Protocol

from loguru import logger

from asyncrl.core.errors import UserError
from asyncrl.transport.files import write_text_atomic
from asyncrl.transport.layout import RunLayout


class WandbSettings(Protocol):
    """What the sink reads of W&B settings (`config.base.WandbConfig` is one): runtime does not import config."""

    project: str
    name: str | None
    id: str | None
    offline: bool
    log_extras: Any  # `samples` / `distributions` switches and their `interval`


class MetricsSink:
    def __init__(
        self,
        layout: RunLayout,
        name: str,
        wandb_cfg: WandbSettings | None = None,
        run_config: dict | None = None,
        enabled: bool = True,
    ):
        self.enabled, self.name = enabled, name
        self.path = layout.metrics_file(name)
        self.wandb_cfg = wandb_cfg
        self.run = None  # the W&B run, when W&B is on
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if wandb_cfg is not None:
            try:
                import wandb
            except ImportError:
                raise UserError("W&B logging is on but wandb is not installed: pip install 'asyncrl[wandb]'") from None
            self.run = wandb.init(
                project=wandb_cfg.project,
                name=wandb_cfg.name,
                id=wandb_cfg.id,
                resume="allow" if wandb_cfg.id else None,
                mode="offline" if wandb_cfg.offline else None,
                config=run_config,
                dir=str(layout.root),
                reinit="create_new",  # a multi-run trainer holds one W&B run per run, side by side
            )

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")
        if self.run is not None:
            numbers = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            self.run.log(numbers, step=step)

    def restart_at(self, step: int) -> None:
        """This run starts at `step`: drop the rows an earlier attempt wrote for steps >= `step`."""
        if self.enabled:
            drop_rows_from(self.path, step)

    def extras_due(self, step: int, kind: str) -> bool:
        """W&B is on, `log_extras.<kind>` (samples / distributions) is on and `step` is on its interval."""
        extras = self.wandb_cfg.log_extras if self.run is not None else None
        return extras is not None and getattr(extras, kind) and step % extras.interval == 0

    def histograms(self, step: int, values: dict[str, Any]) -> None:
        """W&B histograms, one per key (a sequence of numbers; empty ones are skipped)."""
        import wandb

        self.run.log({k: wandb.Histogram(list(v)) for k, v in values.items() if len(v)}, step=step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
        logger.debug(f"metrics in {self.path}")


def drop_rows_from(path: Path, step: int) -> int:
    """Rewrite the JSON-lines file `path` (atomically) without its rows of steps >= `step`; how many went."""
    if not path.exists():
        return 0
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    kept = [line for line in lines if _step(line) < step]
    if len(kept) < len(lines):
        write_text_atomic(path, "".join(line + "\n" for line in kept))
        logger.info(f"{path.name}: dropped {len(lines) - len(kept)} rows of steps >= {step} (this run redoes them)")
    return len(lines) - len(kept)


def _step(line: str) -> float:
    try:
        return json.loads(line).get("step", -1)
    except ValueError:  # a torn last line of a killed writer: drop it with the redone steps
        return float("inf")
