"""Resolve a config from the seeds' four sources: CLI > later @file > earlier @file > PRIME_ env > default.

Command-line grammar (what every entrypoint accepts):

    @ file.toml  |  @file.toml          a TOML (or JSON) file for the whole config
    --section @ file.toml               a file for one section (e.g. `rl --trainer @ t.toml`)
    --a.b value | --a.b=value           set a value (kebab-case or snake_case)
    --flag / --no-flag                  booleans
    --section / --no-section            enable an optional section with defaults / disable it
    PRIME_A__B=value                    environment variable (`__` nests)

Files are applied in the order given, then CLI values on top, whatever their position on the line.
"""

from __future__ import annotations

import ast
import difflib
import json
import os
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from asyncrl.utils.errors import UserError

ENV_PREFIX = "PRIME_"


# ---------------------------------------------------------------- schema walking


def _unwrap(annotation: Any) -> tuple[Any, bool]:
    """(inner type, is_optional) for `X | None` / `Optional[X]`."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        optional = len(args) < len(typing.get_args(annotation))
        if len(args) == 1:
            return args[0], optional
        return annotation, optional
    return annotation, False


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


@dataclass
class Leaf:
    """What a dotted key resolves to."""

    path: tuple[str, ...]
    annotation: Any  # unwrapped type
    optional: bool

    @property
    def dotted(self) -> str:
        return ".".join(self.path)

    @property
    def is_section(self) -> bool:
        return _is_model(self.annotation)

    @property
    def is_bool(self) -> bool:
        return self.annotation is bool


def _field_names(model: type[BaseModel]) -> dict[str, Any]:
    return {name: f.annotation for name, f in model.model_fields.items()}


def all_keys(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> list[str]:
    """Every dotted key the model accepts (sections included), for suggestions and --help."""
    keys = []
    for name, ann in _field_names(model).items():
        inner, _ = _unwrap(ann)
        keys.append(".".join(prefix + (name,)))
        if _is_model(inner):
            keys.extend(all_keys(inner, prefix + (name,)))
    return keys


def suggest(model: type[BaseModel], wrong: str) -> str:
    keys = all_keys(model)
    close = difflib.get_close_matches(wrong, keys, n=1, cutoff=0.6)
    if not close:  # a right leaf name under a wrong section: match on the last part
        tail = wrong.rsplit(".", 1)[-1]
        close = [k for k in keys if k.rsplit(".", 1)[-1] == tail][:1]
    return f"; did you mean '{close[0]}'?" if close else ""


def resolve(model: type[BaseModel], dotted: str) -> Leaf | None:
    """Resolve 'a.b-c' against the schema (dashes and underscores both accepted); None if unknown."""
    aliases = getattr(model, "cli_aliases", {})
    dotted = aliases.get(dotted.replace("-", "_"), dotted)
    current: Any = model
    path: list[str] = []
    parts = dotted.split(".")
    for i, raw in enumerate(parts):
        name = raw.replace("-", "_")
        fields = _field_names(current)
        if name not in fields:
            return None
        inner, optional = _unwrap(fields[name])
        path.append(name)
        if i == len(parts) - 1:
            return Leaf(tuple(path), inner, optional)
        if not _is_model(inner):
            return None
        current = inner
    return None


def normalize_keys(
    model: type[BaseModel], data: Any, source: str, prefix: tuple[str, ...] = (), root: type[BaseModel] | None = None
) -> dict:
    """Check a nested dict's keys against the schema (kebab-case accepted) and return it snake_cased.

    Keys inside free-form dict fields (e.g. env `args`) are left alone. `root` (the model `prefix` starts
    from) is used to suggest the closest valid key.
    """
    root = root or model
    if not isinstance(data, dict):
        where = ".".join(prefix) or "the top level"
        raise UserError(f"{source}: '{where}' must be a table, got {type(data).__name__}")
    fields = _field_names(model)
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        dotted = ".".join(prefix + (name,))
        if name not in fields:
            raise UserError(f"{source}: unknown key '{dotted}'{suggest(root, dotted)}")
        inner, _ = _unwrap(fields[name])
        if _is_model(inner) and isinstance(value, dict):
            value = normalize_keys(inner, value, source, prefix + (name,), root)
        elif _is_model(inner) and value is not None:
            raise UserError(
                f"{source}: '{dotted}' is a section; write it as a table [{dotted}] with its own keys, "
                f"not a single value ({value!r})"
            )
        elif typing.get_origin(inner) is list and _list_item_model(inner) and isinstance(value, list):
            item = _list_item_model(inner)
            value = [
                normalize_keys(item, v, source, (f"{dotted}[{i}]",), item) if isinstance(v, dict) else v
                for i, v in enumerate(value)
            ]
        out[name] = value
    return out


def _list_item_model(tp: Any) -> type[BaseModel] | None:
    args = typing.get_args(tp)
    return args[0] if args and _is_model(args[0]) else None


# ---------------------------------------------------------------- values


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
    for parse in (json.loads, ast.literal_eval):
        try:
            return parse(raw)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
    return raw


def set_path(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for part in path[:-1]:
        node = tree.get(part)
        if not isinstance(node, dict):
            node = {}
            tree[part] = node
        tree = node
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


# ---------------------------------------------------------------- sources


def load_file(model: type[BaseModel], path: str | Path, scope: tuple[str, ...] = ()) -> dict:
    """Read a TOML (or .json) config file into a dict nested under `scope`, keys checked."""
    p = Path(path)
    if not p.is_file():
        hint = " (it is a directory)" if p.is_dir() else ""
        raise UserError(f"config file not found: {path}{hint}")
    text = p.read_text()
    try:
        data = json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"invalid TOML in {path}: {e}") from None
    except json.JSONDecodeError as e:
        raise UserError(f"invalid JSON in {path}: {e}") from None
    target: Any = model
    for part in scope:
        target = _unwrap(_field_names(target)[part])[0]
    checked = normalize_keys(target, data, str(path), scope, model)
    for part in reversed(scope):
        checked = {part: checked}
    return checked


def from_env(model: type[BaseModel], environ: Mapping[str, str], prefix: str = ENV_PREFIX) -> dict:
    """PRIME_A__B=v -> {'a': {'b': v}}; names that match no option are errors."""
    out: dict = {}
    for name in sorted(environ):
        if not name.startswith(prefix):
            continue
        dotted = ".".join(part.lower() for part in name[len(prefix) :].split("__"))
        leaf = resolve(model, dotted)
        if leaf is None:
            raise UserError(f"environment variable {name} matches no option{suggest(model, dotted)} (unset it)")
        if leaf.is_section:
            set_path(out, leaf.path, parse_value(leaf, environ[name]) if environ[name].strip() else {})
        else:
            set_path(out, leaf.path, parse_value(leaf, environ[name]))
    return out


@dataclass
class ParsedArgs:
    files: list[tuple[tuple[str, ...], str]] = field(default_factory=list)  # (scope, path) in order
    cli: dict = field(default_factory=dict)
    passthrough: list[str] = field(default_factory=list)
    help: bool = False
    dry_run: bool = False


def parse_argv(model: type[BaseModel], argv: list[str], passthrough: bool = False) -> ParsedArgs:
    """Split argv into config files, CLI values and (optionally) unknown flags to pass through."""
    out = ParsedArgs()
    i = 0

    def next_value(flag: str) -> str:
        nonlocal i
        if i + 1 >= len(argv):
            raise UserError(f"{flag} needs a value")
        i += 1
        return argv[i]

    while i < len(argv):
        tok = argv[i]
        if tok in ("-h", "--help"):
            out.help = True
        elif tok == "--dry-run":
            out.dry_run = True
        elif tok == "@":
            out.files.append(((), next_value("@")))
        elif tok.startswith("@"):
            out.files.append(((), tok[1:]))
        elif tok.startswith("--"):
            key, eq, inline = tok[2:].partition("=")
            leaf = resolve(model, key)
            negated = False
            if leaf is None and key.startswith("no-"):
                leaf = resolve(model, key[3:])
                negated = leaf is not None
                if negated and not (leaf.is_bool or (leaf.is_section and leaf.optional)):
                    raise UserError(f"--{key}: --no- only applies to on/off options, and {key[3:]} is not one")
            if leaf is None:
                if passthrough:
                    out.passthrough.append(tok)
                    if not eq and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                        i += 1
                        out.passthrough.append(argv[i])
                    i += 1
                    continue
                raise UserError(f"unknown option --{key}{suggest(model, key.replace('-', '_'))}")
            if negated:
                set_path(out.cli, leaf.path, None if leaf.is_section else False)
            elif leaf.is_section:
                follows = inline if eq else (argv[i + 1] if i + 1 < len(argv) else None)
                if follows is not None and follows.startswith("@"):
                    path = follows[1:] or (argv[i + 2] if not eq and i + 2 < len(argv) else "")
                    if not path:
                        raise UserError(f"--{key} @ needs a file path after '@'")
                    i += 0 if eq else (1 if follows != "@" else 2)
                    out.files.append((leaf.path, path))
                elif eq:
                    set_path(out.cli, leaf.path, parse_value(leaf, inline))
                elif follows is not None and follows.lstrip().startswith("{"):  # --data.fake "{'seq_len': 8}"
                    i += 1
                    set_path(out.cli, leaf.path, parse_value(leaf, follows))
                else:  # bare section flag: enable with defaults (merges with values set elsewhere)
                    set_path(out.cli, leaf.path, get_path(out.cli, leaf.path) or {})
            elif leaf.is_bool:
                if eq:
                    set_path(out.cli, leaf.path, inline)
                elif i + 1 < len(argv) and argv[i + 1].lower() in ("true", "false"):
                    i += 1
                    set_path(out.cli, leaf.path, argv[i].lower() == "true")
                else:
                    set_path(out.cli, leaf.path, True)
            else:
                set_path(out.cli, leaf.path, parse_value(leaf, inline if eq else next_value(f"--{key}")))
        else:
            raise UserError(f"unexpected argument {tok!r}: options start with --, config files with '@ '")
        i += 1
    return out


def get_path(tree: dict, path: tuple[str, ...]) -> Any:
    for part in path:
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


# ---------------------------------------------------------------- validation


def format_validation_error(err: ValidationError, data: dict) -> str:
    """One line for the first problem: which key, what was wrong, what was given."""
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"] if not str(p).startswith("function-"))
    msg = first["msg"].removeprefix("Value error, ")
    given = first.get("input")
    if loc:
        shown = "" if isinstance(given, dict) else f" (got {given!r})"
        return f"invalid value for '{loc}': {msg}{shown}"
    return msg


def validate(model: type[BaseModel], data: dict):
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise UserError(format_validation_error(err, data)) from None


def collect_raw(
    model: type[BaseModel],
    argv: list[str],
    environ: Mapping[str, str] | None = None,
    passthrough: bool = False,
) -> tuple[dict, ParsedArgs]:
    """Merge env < files (in order) < CLI into one raw dict (not yet validated)."""
    args = parse_argv(model, argv, passthrough=passthrough)
    raw = from_env(model, os.environ if environ is None else environ)
    for scope, path in args.files:
        raw = deep_merge(raw, load_file(model, path, scope))
    raw = deep_merge(raw, args.cli)
    return raw, args


def load_config(model: type[BaseModel], argv: list[str], environ: Mapping[str, str] | None = None):
    """Resolve `model` from argv + environment; raises UserError with a one-line message."""
    raw, _ = collect_raw(model, argv, environ)
    return validate(model, raw)
