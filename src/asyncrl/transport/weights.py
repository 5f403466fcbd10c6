"""Weight dirs: the trainer publishes HF-format weights per step, the orchestrator points the server at them.

On disk (under the run's output dir)::

    broadcast/step_{n}/               HF dir: model.safetensors (or shards), config.json, tokenizer files
    broadcast/step_{n}/STABLE         empty marker, written last: the dir is complete
    weights/step_{n}/                 same HF format, kept for eval/resume at checkpoint steps and the end

Steps are 0-based, as in the seeds' step definition: `step_{n}` holds the policy after n updates
("ckpt n"; step 0 is the base model and is never written). Trainer step n consumes `rollouts/step_{n}`
and publishes `broadcast/step_{n+1}`. Rollouts of step n come from a policy >= n-k: before generating
for step n the orchestrator waits for `broadcast/step_{n-k}` (n-k <= 0: the base model). A run with
max_steps = N runs steps 0..N-1 and ends with `step_{N}`; a checkpoint `step_{N}` resumes at step N.
The dir is filled under a temporary name, renamed into place, and
only then is `STABLE` created (itself via a temp name), so a reader that sees `STABLE` sees whole files.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from pathlib import Path

from asyncrl.transport.files import STABLE, wait_for

_STEP_DIR = re.compile(r"^step_(\d+)$")


def broadcast_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / "broadcast" / f"step_{step}"


def weights_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / "weights" / f"step_{step}"


def is_stable(path: str | Path) -> bool:
    return (Path(path) / STABLE).exists()


def step_dirs(root: str | Path) -> dict[int, Path]:
    """`step_N` subdirs of `root` by step (temp dirs and other names are ignored)."""
    root = Path(root)
    if not root.is_dir():
        return {}
    found = {}
    for d in root.iterdir():
        m = _STEP_DIR.match(d.name)
        if m and d.is_dir():
            found[int(m.group(1))] = d
    return dict(sorted(found.items()))


def wait_for_weights(
    output_dir: str | Path,
    step: int,
    timeout: float | None = None,
    poll: float = 0.05,
    should_stop: Callable[[], bool] | None = None,
) -> Path:
    """Block until `broadcast/step_{step}` is STABLE; TimeoutError after `timeout` seconds."""
    path = broadcast_dir(output_dir, step)
    wait_for(lambda: is_stable(path), f"stable weights for step {step} at {path}", timeout, poll, should_stop)
    return path


def prune_broadcast(output_dir: str | Path, keep_from_step: int, keep: set[int] = frozenset()) -> list[int]:
    """Delete broadcast dirs of steps < keep_from_step except those in `keep`; returns the deleted steps."""
    deleted = []
    for step, path in step_dirs(Path(output_dir) / "broadcast").items():
        if step < keep_from_step and step not in keep:
            shutil.rmtree(path, ignore_errors=True)
            deleted.append(step)
    return deleted
