"""Who is who in a comparison: each run's label, colour and config group, from its `configs/*.toml`.

A label names what differs between the runs' resolved configs (`k=1 seed=3`), never what is the same;
fields that differ by construction (output dirs, ports, hosts, paths under the run dir) are not a
difference, nor are fields only some configs have (written by another version of asyncrl). Runs whose
configs are the same but for seeds share a group (their spread is over seeds).
Labels may be given instead (`--label`), one per run. Invariants: labels are unique (a dir name is added
to any that collide); a run's colour is the same in every plot, by its position in the command line.
"""

from __future__ import annotations

import colorsys
import tomllib
from dataclasses import dataclass
from pathlib import Path

from asyncrl.core.errors import UserError

# ten colours far apart, then evenly spaced hues: run i has colour i in every plot
PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]
INCIDENTAL = {"output_dir", "port", "host", "base_url", "url", "dir", "path", "file", "log_file", "wandb_name"}
SHORT = {"max_async_level": "k", "lr": "lr", "seed": "seed"}


@dataclass(frozen=True)
class Identity:
    label: str
    colour: str
    group: str  # runs with the same group differ only in seeds


def colour(i: int) -> str:
    if i < len(PALETTE):
        return PALETTE[i]
    r, g, b = colorsys.hls_to_rgb(((i - len(PALETTE)) * 0.618034) % 1.0, 0.45, 0.65)
    return f"#{int(r * 255):02x}{int(g * 255):02x}{int(b * 255):02x}"


def flat_config(run: Path) -> dict[str, str]:
    """Every field of the run's resolved configs as `component.dotted.key` -> its value, written out."""
    out: dict[str, str] = {}
    for path in sorted((run / "configs").glob("*.toml")):
        try:
            _flatten(tomllib.loads(path.read_text()), path.stem, out)
        except (OSError, tomllib.TOMLDecodeError):
            continue
    return {k: v for k, v in out.items() if not _incidental(k, v, run)}


def _flatten(node, prefix: str, out: dict[str, str]) -> None:
    if isinstance(node, dict):
        for k, v in node.items():
            _flatten(v, f"{prefix}.{k}", out)
    else:
        out[prefix] = str(node)


def _incidental(key: str, value: str, run: Path) -> bool:
    leaf = key.rsplit(".", 1)[-1]
    return leaf in INCIDENTAL or leaf.endswith(("_dir", "_path", "_port")) or str(run) in value


def differences(runs: list[Path]) -> list[list[tuple[str, str]]]:
    """Per run, the (short name, value) of each field whose values differ across runs; one name per field
    (trainer.seed and orchestrator.seed with the same values are one `seed`)."""
    configs = [flat_config(r) for r in runs]
    keys = sorted(set.intersection(*(set(c) for c in configs)))  # a field some lack: another version's config
    varying = [k for k in keys if len({c[k] for c in configs}) > 1]
    seen: dict[tuple[str, tuple], None] = {}
    for k in varying:
        seen.setdefault((_short(k, varying), tuple(c[k] for c in configs)), None)
    return [[(name, vals[i]) for name, vals in seen] for i in range(len(runs))]


def _short(key: str, varying: list[str]) -> str:
    leaf = key.rsplit(".", 1)[-1]
    clash = [k for k in varying if k.rsplit(".", 1)[-1] == leaf and k.split(".", 1)[1] != key.split(".", 1)[1]]
    return SHORT.get(leaf, leaf) if not clash else key.split(".", 1)[1]


def identities(runs: list[Path], given: list[str] | None = None) -> list[Identity]:
    if given is not None and len(given) != len(runs):
        raise UserError(f"{len(given)} --label for {len(runs)} runs: give one --label per run, in the runs' order")
    diffs = differences(runs) if len(runs) > 1 else [[] for _ in runs]
    labels = given or [" ".join(f"{n}={v}" for n, v in d) or r.name for r, d in zip(runs, diffs)]
    labels = _unique(labels, runs)
    groups = [" ".join(f"{n}={v}" for n, v in d if "seed" not in n) or "all" for d in diffs]
    return [Identity(lbl, colour(i), g) for i, (lbl, g) in enumerate(zip(labels, groups))]


def _unique(labels: list[str], runs: list[Path]) -> list[str]:
    out = []
    for label, run in zip(labels, runs):
        twice = labels.count(label) > 1
        out.append(f"{label} ({run.parent.name}/{run.name})" if twice else label)
    return out
