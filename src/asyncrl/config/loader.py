"""Resolve a config model from four sources: CLI > later @file > earlier @file > PRIME_ env > default.

Command-line grammar (what every entrypoint accepts):

    @ file.toml  |  @file.toml          a TOML (or JSON) file for the whole config
    --section @ file.toml               a file for one section (e.g. `rl --trainer @ t.toml`)
    --a.b value | --a.b=value           set a value (kebab-case or snake_case)
    --flag / --no-flag                  booleans
    --section / --no-section            enable an optional section with defaults / disable it
    PRIME_A__B=value                    environment variable (`__` nests)

Invariants:
- Every source becomes a nested dict with snake_case keys checked against the schema; the dicts are
  deep-merged env < files (in the order given) < CLI values, whatever their position on the line, and
  pydantic validates the result once.
- Settings alone do not switch W&B on: a `wandb` section that ends up holding only `log_extras` is off,
  unless some source switched it on bare (`--wandb`, an empty `[wandb]`, `PRIME_WANDB=`); any other key
  (`--wandb.project p`) switches it on.
- A key that matches no option is a `UserError` naming the source and the closest valid key; no user
  mistake escapes as another exception.
- The schema (`schema()`) is walked once per model and shared by lookups, suggestions and `--help`.

Why not pydantic-settings' `CliSettingsSource`: it has precedence and `__` env nesting, but no `@ file`
grammar (let alone per-section files), and it rejects `--snake_case` flags in kebab mode, `--flag false`,
`--no-section` and Python-literal dicts; an unknown flag gets argparse's whole usage block and no
suggestion. PRIME-RL also moved off it, to its own parser with `@` files and deep merge.
"""

from __future__ import annotations

import ast
import difflib
import functools
import json
import os
import re
import sys
import tomllib
import types
import typing
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from asyncrl.utils.errors import UserError

ENV_PREFIX = "PRIME_"


# ---------------------------------------------------------------- schema


def _unwrap(annotation: Any) -> tuple[Any, bool]:
    """(inner type, is_optional) for `X | None` / `Optional[X]`."""
    if typing.get_origin(annotation) not in (typing.Union, types.UnionType):
        return annotation, False
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    optional = len(args) < len(typing.get_args(annotation))
    return (args[0] if len(args) == 1 else annotation), optional


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


@dataclass(frozen=True)
class Leaf:
    """One option of a model: its path from the root, unwrapped type, optionality and pydantic field."""

    path: tuple[str, ...]
    annotation: Any
    optional: bool
    info: FieldInfo

    @property
    def dotted(self) -> str:
        return ".".join(self.path)

    @property
    def is_section(self) -> bool:
        return _is_model(self.annotation)

    @property
    def is_bool(self) -> bool:
        return self.annotation is bool


@functools.cache
def fields(model: type[BaseModel]) -> dict[str, Leaf]:
    """The model's own fields, by snake_case name."""
    return {name: Leaf((name,), *_unwrap(f.annotation), f) for name, f in model.model_fields.items()}


@functools.cache
def schema(model: type[BaseModel]) -> dict[str, Leaf]:
    """Every option of the model by dotted key, sections included, depth-first in declaration order."""
    out = {}
    for name, leaf in fields(model).items():
        out[name] = leaf
        if leaf.is_section:
            for key, sub in schema(leaf.annotation).items():
                out[f"{name}.{key}"] = replace(sub, path=(name, *sub.path))
    return out


def all_keys(model: type[BaseModel]) -> list[str]:
    """Every dotted key the model accepts (sections included), for suggestions and --help."""
    return list(schema(model))


def suggest(model: type[BaseModel], wrong: str) -> str:
    """The `; did you mean 'x.y'?` hint: the closest key, else the same leaf name under another section."""
    keys = all_keys(model)
    close = difflib.get_close_matches(wrong, keys, n=1, cutoff=0.6)
    if not close:
        tail = wrong.rsplit(".", 1)[-1]
        close = [k for k in keys if k.rsplit(".", 1)[-1] == tail][:1]
    return f"; did you mean '{close[0]}'?" if close else ""


# options the seeds show that do not exist here: what to do instead
NOT_HERE = {
    "model.cp": "context parallelism (one sequence split over several GPUs) is not implemented: PyTorch's "
    "context-parallel attention needs CUDA GPUs (it has no CPU kernel), so it could not be built and tested here; "
    "to fit long sequences use --model.ac (activation checkpointing), data.micro_batch_size 1 or a lower seq_len",
}
COMPONENTS = ("trainer", "orchestrator", "inference")


def unknown_option(model: type[BaseModel], flag: str) -> str:
    """The message for `--flag` that names no option (CLI parsing and vLLM pass-through share it)."""
    key = flag.replace("-", "_")
    for name, fix in NOT_HERE.items():
        if key == name or key.endswith(f".{name}"):
            return f"--{flag}: {fix}"
    head, _, rest = key.partition(".")
    if head in COMPONENTS and not any(k.startswith(f"{head}.") for k in schema(model)):
        return f"unknown option --{flag}: the {head} has no option '{rest}'{suggest(_component_model(head), rest)}"
    return f"unknown option --{flag}{suggest(model, key)}"


# older spellings the seeds use, as dotted key parts -> today's (one note each, then accepted)
OLDER_SPELLINGS = {"monitor.wandb": "wandb"}
_noted: set[str] = set()


def note_older_spelling(old: str, new: str) -> None:
    """One stderr line, once per process, saying an accepted spelling is the older one."""
    note_once(old, f"note: {old} is the older spelling of {new}")


def note_once(key: str, line: str) -> None:
    if key not in _noted:
        _noted.add(key)
        print(line, file=sys.stderr)


def _other_components_option(model: type[BaseModel], key: str) -> Leaf | None:
    """The option `--component.x` names in another component's config (one this model has no section for)."""
    head, _, rest = key.replace("-", "_").partition(".")
    if head not in COMPONENTS or not rest or any(k.startswith(f"{head}.") for k in schema(model)):
        return None
    return resolve(_component_model(head), rest)


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


def resolve(model: type[BaseModel], dotted: str) -> Leaf | None:
    """The option 'a.b-c' names (dashes or underscores, an alias or an older spelling); None if unknown."""
    return schema(model).get(unalias(model, dotted.replace("-", "_")))


# ---------------------------------------------------------------- dicts from files


def normalize_keys(
    model: type[BaseModel], data: Any, source: str, prefix: tuple[str, ...], root: type[BaseModel]
) -> dict:
    """Check a nested dict's keys against `model` (kebab-case accepted) and return it snake_cased.

    Keys inside free-form dict fields (e.g. env `args`) are left alone. `prefix` is where `data` sits
    under `root`, the model used to suggest the closest valid key.
    """
    if not isinstance(data, dict):
        raise UserError(f"{source}: '{'.'.join(prefix) or 'the top level'}' must be a table, got {type(data).__name__}")
    out: dict[str, Any] = {}
    for key, value in data.items():
        name, own = key.replace("-", "_"), fields(model)
        if name not in own:
            dotted = ".".join(prefix + (name,))
            raise UserError(f"{source}: unknown key '{dotted}'{suggest(root, dotted)}")
        out[name] = _normalize_value(own[name].annotation, value, source, prefix + (name,), root)
    return out


def _normalize_value(tp: Any, value: Any, source: str, path: tuple[str, ...], root: type[BaseModel]) -> Any:
    """Recurse into sections and lists of sections; a section given a single value is an error."""
    dotted = ".".join(path)
    if _is_model(tp) and isinstance(value, dict):
        return normalize_keys(tp, value, source, path, root)
    if _is_model(tp) and value is not None:
        raise UserError(
            f"{source}: '{dotted}' is a section; write it as a table [{dotted}] with its own keys, "
            f"not a single value ({value!r})"
        )
    item = _list_item_model(tp)
    if item is not None and isinstance(value, list):
        return [
            normalize_keys(item, v, source, (f"{dotted}[{i}]",), item) if isinstance(v, dict) else v
            for i, v in enumerate(value)
        ]
    return value


def _list_item_model(tp: Any) -> type[BaseModel] | None:
    args = typing.get_args(tp)
    return args[0] if typing.get_origin(tp) is list and args and _is_model(args[0]) else None


# ---------------------------------------------------------------- values and trees


def parse_value(leaf: Leaf, raw: str) -> Any:
    """Turn a CLI/env string into a value pydantic can validate for `leaf`."""
    tp = leaf.annotation
    if raw.lower() in ("none", "null") and leaf.optional:
        return None
    origin = typing.get_origin(tp)
    if origin in (list, tuple, set) or tp in (list, tuple, set):
        parsed = _literal(raw)
        if isinstance(parsed, (list, tuple)):
            return list(parsed)
        return [s.strip() for s in raw.split(",") if s.strip()]
    if origin is dict or tp is dict or _is_model(tp):
        parsed = _literal(raw)
        if not isinstance(parsed, dict):
            raise UserError(f"--{leaf.dotted.replace('_', '-')} expects a dict like '{{\"key\": 1}}', got {raw!r}")
        return parsed
    return raw  # scalars: pydantic's lax mode converts "10", "1e-6", "true", paths, literals


def _literal(raw: str) -> Any:
    """JSON, else a Python literal, else the string itself."""
    for parse in (json.loads, ast.literal_eval):
        try:
            return parse(raw)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
    return raw


def get_path(tree: dict, path: tuple[str, ...]) -> Any:
    for part in path:
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


def set_path(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for part in path[:-1]:
        if not isinstance(tree.get(part), dict):
            tree[part] = {}
        tree = tree[part]
    tree[path[-1]] = value


def deep_merge(base: dict, override: dict) -> dict:
    """Recursively merge `override` onto `base` (lists and scalars replace)."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


# ---------------------------------------------------------------- sections that settings alone do not switch on

SWITCHED_ON = "__switched_on__"  # a source switched the section on bare; removed before validation
SETTINGS_ONLY = {"wandb": {"log_extras"}}  # section -> the keys that configure it without switching it on


def mark_switched_on(source: dict) -> dict:
    """In one source (before merging): mark each SETTINGS_ONLY section it gives bare (`{}`)."""
    out = {}
    for key, value in source.items():
        if isinstance(value, dict):
            value = {SWITCHED_ON: True} if key in SETTINGS_ONLY and not value else mark_switched_on(value)
        out[key] = value
    return out


def settle_switches(raw: dict) -> dict:
    """Drop the marks; a SETTINGS_ONLY section holding only its settings, never switched on, is off (absent)."""
    out = {}
    for key, value in raw.items():
        if isinstance(value, dict):
            switched = value.get(SWITCHED_ON, False)
            value = settle_switches({k: v for k, v in value.items() if k != SWITCHED_ON})
            if key in SETTINGS_ONLY and value and set(value) <= SETTINGS_ONLY[key] and not switched:
                continue
        out[key] = value
    return out


# ---------------------------------------------------------------- sources: files and environment


def _read(path: str | Path) -> Any:
    """Parse a TOML (or .json) file; a missing or malformed file is a UserError naming it."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"config file not found: {path}{' (it is a directory)' if p.is_dir() else ''}")
    text = p.read_text()
    try:
        return json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"invalid TOML in {path}: {e}") from None
    except json.JSONDecodeError as e:
        raise UserError(f"invalid JSON in {path}: {e}") from None


def load_file(model: type[BaseModel], path: str | Path, scope: tuple[str, ...] = ()) -> dict:
    """Read a config file into a dict nested under `scope` (a section's path), keys checked."""
    target = schema(model)[".".join(scope)].annotation if scope else model
    checked = normalize_keys(target, _read(path), str(path), scope, model)
    for part in reversed(scope):
        checked = {part: checked}
    return checked


def from_env(model: type[BaseModel], environ: Mapping[str, str], prefix: str = ENV_PREFIX) -> dict:
    """PRIME_A__B=v -> {'a': {'b': v}}; names that match no option are errors, an empty section enables it."""
    out: dict = {}
    for name in sorted(n for n in environ if n.startswith(prefix)):
        dotted = ".".join(part.lower() for part in name[len(prefix) :].split("__"))
        leaf = resolve(model, dotted)
        if leaf is None:
            raise UserError(f"environment variable {name} matches no option{suggest(model, dotted)} (unset it)")
        raw = environ[name]
        set_path(out, leaf.path, {} if leaf.is_section and not raw.strip() else parse_value(leaf, raw))
    return out


# ---------------------------------------------------------------- source: command line


@dataclass
class ParsedArgs:
    files: list[tuple[tuple[str, ...], str]] = field(default_factory=list)  # (scope, path) in order
    cli: dict = field(default_factory=dict)
    passthrough: list[str] = field(default_factory=list)
    dry_run: bool = False


def _value(tokens: deque[str], flag: str) -> str:
    if not tokens:
        raise UserError(f"{flag} needs a value")
    return tokens.popleft()


def parse_argv(model: type[BaseModel], argv: list[str], passthrough: bool = False) -> ParsedArgs:
    """Split argv into config files, CLI values and (optionally) unknown flags to pass through."""
    out, tokens = ParsedArgs(), deque(argv)
    while tokens:
        tok = tokens.popleft()
        if tok in ("-h", "--help"):
            continue  # answered before parsing, by cli.parse_or_exit
        if tok == "--dry-run":
            out.dry_run = True
        elif tok.startswith("@"):
            out.files.append(((), tok[1:] or _value(tokens, "@")))
        elif tok.startswith("--"):
            _option(model, tok, tokens, out, passthrough)
        else:
            raise UserError(f"unexpected argument {tok!r}: options start with --, config files with '@ '")
    return out


def _flag(model: type[BaseModel], key: str) -> tuple[Leaf | None, bool]:
    """(option, negated) for `--key`: `--no-x` negates a boolean or an optional section x."""
    leaf = resolve(model, key)
    if leaf is not None or not key.startswith("no-"):
        return leaf, False
    leaf = resolve(model, key[3:])
    if leaf is not None and not (leaf.is_bool or (leaf.is_section and leaf.optional)):
        raise UserError(f"--{key}: --no- only applies to on/off options, and {key[3:]} is not one")
    return leaf, leaf is not None


def _option(model: type[BaseModel], tok: str, tokens: deque[str], out: ParsedArgs, passthrough: bool) -> None:
    """Consume one `--key[=value]` (and its value, if it takes one) into `out`."""
    key, eq, inline = tok[2:].partition("=")
    value = inline if eq else None
    leaf, negated = _flag(model, key)
    other = _other_components_option(model, key) if leaf is None else None
    if other is not None:  # e.g. the seeds' `trainer ... --orchestrator.monitor.wandb.id ID`
        head = key.split(".", 1)[0]
        note_once(key, f"note: --{key} configures the {head}; this entrypoint ignores it (the {head} reads it)")
        if value is None and not other.is_bool and not other.is_section:
            _value(tokens, f"--{key}")
        return
    if leaf is None and not passthrough:
        raise UserError(unknown_option(model, key))
    if leaf is None:  # kept for vLLM, with its value if one follows
        out.passthrough.append(tok)
        if value is None and tokens and not tokens[0].startswith("--"):
            out.passthrough.append(tokens.popleft())
    elif negated:
        set_path(out.cli, leaf.path, None if leaf.is_section else False)
    elif leaf.is_section:
        _section(leaf, key, value, tokens, out)
    elif leaf.is_bool:
        set_path(out.cli, leaf.path, value if value is not None else _bool_word(tokens))
    else:
        set_path(out.cli, leaf.path, parse_value(leaf, value if value is not None else _value(tokens, f"--{key}")))


def _bool_word(tokens: deque[str]) -> bool:
    """A following 'true'/'false' is the flag's value (consumed); a bare flag means True."""
    if tokens and tokens[0].lower() in ("true", "false"):
        return tokens.popleft().lower() == "true"
    return True


def _section(leaf: Leaf, key: str, value: str | None, tokens: deque[str], out: ParsedArgs) -> None:
    """`--s @ f.toml` (file for the section), `--s=DICT` / `--s '{...}'`, or bare `--s` (enable, defaults)."""
    follows = value if value is not None else (tokens[0] if tokens else None)
    if follows is not None and follows.startswith("@"):
        if value is None:
            tokens.popleft()
        path = follows[1:] or (tokens.popleft() if value is None and tokens else None)
        if not path:
            raise UserError(f"--{key} @ needs a file path after '@'")
        out.files.append((leaf.path, path))
    elif value is not None:
        set_path(out.cli, leaf.path, parse_value(leaf, value))
    elif follows is not None and follows.lstrip().startswith("{"):  # --data.fake "{'seq_len': 8}"
        set_path(out.cli, leaf.path, parse_value(leaf, tokens.popleft()))
    else:  # merges with values set elsewhere on the line
        section = dict(get_path(out.cli, leaf.path) or {})
        if leaf.path[-1] in SETTINGS_ONLY:
            section[SWITCHED_ON] = True
        set_path(out.cli, leaf.path, section)


# ---------------------------------------------------------------- merge and validate


def format_validation_error(err: ValidationError) -> str:
    """One line for the first problem: which key, what was wrong, what was given."""
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"] if not str(p).startswith("function-"))
    msg = first["msg"].removeprefix("Value error, ")
    if not loc:
        return msg
    given = first.get("input")
    return f"invalid value for '{loc}': {msg}" + ("" if isinstance(given, dict) else f" (got {given!r})")


def validate(model: type[BaseModel], data: dict):
    try:
        return model.model_validate(settle_switches(data))
    except ValidationError as err:
        raise UserError(format_validation_error(err)) from None


def collect_raw(
    model: type[BaseModel],
    argv: list[str],
    environ: Mapping[str, str] | None = None,
    passthrough: bool = False,
) -> tuple[dict, ParsedArgs]:
    """Merge env < files (in order) < CLI into one raw dict (not yet validated)."""
    args = parse_argv(model, argv, passthrough=passthrough)
    raw = mark_switched_on(from_env(model, os.environ if environ is None else environ))
    for scope, path in args.files:
        raw = deep_merge(raw, mark_switched_on(load_file(model, path, scope)))
    return deep_merge(raw, mark_switched_on(args.cli)), args


def load_config(model: type[BaseModel], argv: list[str], environ: Mapping[str, str] | None = None):
    """Resolve `model` from argv + environment; raises UserError with a one-line message."""
    raw, _ = collect_raw(model, argv, environ)
    return validate(model, raw)
