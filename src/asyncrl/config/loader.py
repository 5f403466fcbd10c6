"""asyncrl's dialect of the command-line grammar (`grammar.py`): the compatibility tables, and the loader API.

Every entrypoint resolves its config here: CLI > later @file > earlier @file > PRIME_ env > default (the
grammar itself, with no asyncrl names, is `grammar.py`). What this module adds to it:

- `OLDER_SPELLINGS`: key parts PRIME-RL's docs and configs spell the older way, accepted at any depth of a
  flag or environment variable with one note on stderr; plus each model's own `cli_aliases` (e.g.
  inference's `--max-model-len`, eval's `--benchmarks`).
- `NOT_HERE`: options the PRIME-RL docs show that do not exist here, with what to do instead.
- `COMPONENTS`: `rl`'s component sections. A component's entrypoint accepts (and ignores, with a note) the
  PRIME-RL's flags for another component, e.g. `trainer ... --orchestrator.monitor.wandb.id ID`; an unknown
  `--trainer.x` names the component that lacks x. (rl's propagation of shared fields is `rl.py`'s.)
- `SETTINGS_ONLY`: settings alone do not switch W&B on: a `wandb` section that ends up holding only
  `log_extras` is off, unless some source switched it on bare (`--wandb`, an empty `[wandb]`,
  `PRIME_WANDB=`); any other key (`--wandb.project p`) switches it on.
- `ENV_PREFIX`: PRIME-RL's `PRIME_` environment variables.

Why not a published parser. pydantic-settings' `CliSettingsSource` has precedence and `__` env nesting, but
no `@ file` grammar (let alone per-section files), and it rejects `--snake_case` flags in kebab mode,
`--flag false`, `--no-section` and Python-literal dicts; an unknown flag gets argparse's whole usage block
and no suggestion. prime-pydantic-config 0.4.3 (PRIME-RL's parser) was run on the before/after harness
(tests/unit/config/test_harness.py): 844 of 2,368 cases gave the same result. It has no environment
variables, no `--section=@file`, `@file` at the top level or `--section` / `--section.x=v` on an optional
section; it reads `--list a,b` as one string; it has no older spellings or aliases, no hook for rl's
CLI-over-files precedence; its errors are multi-line boxes with exit 1, and a directory or a non-table file
given with `@` escapes as a traceback.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from pydantic import BaseModel

from asyncrl.config import grammar
from asyncrl.config.grammar import Leaf, ParsedArgs, schema, suggest
from asyncrl.config.grammar import _is_model as _is_model
from asyncrl.config.grammar import _unwrap as _unwrap
from asyncrl.config.grammar import all_keys as all_keys
from asyncrl.config.grammar import deep_merge as deep_merge
from asyncrl.config.grammar import get_path as get_path
from asyncrl.config.grammar import set_path as set_path
from asyncrl.config.notes import _noted as _noted
from asyncrl.config.notes import note_older_spelling as note_older_spelling
from asyncrl.config.notes import note_once

ENV_PREFIX = "PRIME_"

# options the PRIME-RL docs show that do not exist here: what to do instead
NOT_HERE = {
    "model.cp": "context parallelism (one sequence split over several GPUs) is not implemented: PyTorch's "
    "context-parallel attention needs CUDA GPUs (it has no CPU kernel), so it could not be built and tested here; "
    "to fit long sequences use --model.ac (activation checkpointing), a lower data.micro_batch_tokens or seq_len",
}
COMPONENTS = ("trainer", "orchestrator", "inference")

# older spellings the PRIME-RL docs use, as dotted key parts -> today's (one note each, then accepted)
OLDER_SPELLINGS = {"monitor.wandb": "wandb"}


SETTINGS_ONLY = {"wandb": {"log_extras"}}  # section -> the keys that configure it without switching it on


def unknown_option(model: type[BaseModel], flag: str) -> str:
    """The message for `--flag` that names no option (CLI parsing and vLLM pass-through share it)."""
    key = flag.replace("-", "_")
    for name, fix in NOT_HERE.items():
        if key == name or key.endswith(f".{name}"):
            return f"--{flag}: {fix}"
    head, _, rest = key.partition(".")
    if head in COMPONENTS and not any(k.startswith(f"{head}.") for k in schema(model)):
        return f"unknown option --{flag}: the {head} has no option '{rest}'{suggest(_component_model(head), rest)}"
    return grammar.plain_unknown(model, flag)


def _other_components_option(model: type[BaseModel], key: str) -> Leaf | None:
    """The option `--component.x` names in another component's config (one this model has no section for);
    the PRIME-RL docs pass such flags to every component, so it is noted once and ignored."""
    head, _, rest = key.replace("-", "_").partition(".")
    if head not in COMPONENTS or not rest or any(k.startswith(f"{head}.") for k in schema(model)):
        return None
    other = resolve(_component_model(head), rest)
    if other is not None:
        note_once(key, f"note: --{key} configures the {head}; this entrypoint ignores it (the {head} reads it)")
    return other


def _component_model(name: str) -> type[BaseModel]:
    from asyncrl.config.inference import InferenceConfig
    from asyncrl.config.orchestrator import OrchestratorConfig
    from asyncrl.config.trainer import TrainerConfig

    return {"trainer": TrainerConfig, "orchestrator": OrchestratorConfig, "inference": InferenceConfig}[name]


def unalias(model: type[BaseModel], key: str) -> str:
    """`key` with a model's `cli_aliases` entry, or an older spelling at any depth, replaced."""
    aliases = getattr(model, "cli_aliases", {})
    if key in aliases:
        return aliases[key]
    for old, new in OLDER_SPELLINGS.items():
        renamed = re.sub(rf"(^|\.){re.escape(old)}(?=\.|$)", rf"\g<1>{new}", key)
        if renamed != key:
            note_older_spelling(f"--{old}.*", f"--{new}.*")
            return renamed
    return key


DIALECT = grammar.Dialect(
    rename=unalias,
    unknown=unknown_option,
    foreign=_other_components_option,
    settings_only=SETTINGS_ONLY,
    env_prefix=ENV_PREFIX,
)


# ---------------------------------------------------------------- the grammar in this dialect


def resolve(model: type[BaseModel], dotted: str) -> Leaf | None:
    """The option 'a.b-c' names (dashes or underscores, an alias or an older spelling); None if unknown."""
    return grammar.resolve(model, dotted, DIALECT)


def validate(model: type[BaseModel], data: dict):
    return grammar.validate(model, data, DIALECT)


def collect_raw(
    model: type[BaseModel],
    argv: list[str],
    environ: Mapping[str, str] | None = None,
    passthrough: bool = False,
) -> tuple[dict, ParsedArgs]:
    """Merge env < files (in order) < CLI into one raw dict (not yet validated)."""
    return grammar.collect_raw(model, argv, os.environ if environ is None else environ, DIALECT, passthrough)


def load_config(model: type[BaseModel], argv: list[str], environ: Mapping[str, str] | None = None):
    """Resolve `model` from argv + environment; raises UserError with a one-line message."""
    raw, _ = collect_raw(model, argv, environ)
    return validate(model, raw)
