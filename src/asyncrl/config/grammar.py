"""The command-line grammar for any pydantic model: argv, `@` files and environment variables into one dict.

    @ file.toml  |  @file.toml          a TOML (or .json) file for the whole config
    --section @ file.toml               a file for one section (also `--section @file.toml`, `--section=@file.toml`)
    --a.b value | --a.b=value           set a value (kebab-case or snake_case)
    --flag [true|false] / --no-flag     booleans
    --section / --no-section            enable an optional section with defaults / disable it
    --section '{...}'                   a section as a JSON or Python-literal dict
    PREFIX_A__B=value                   environment variable (`__` nests; an empty value enables a section)

Invariants:
- Every source becomes a nested dict with snake_case keys checked against the schema; the dicts are
  deep-merged env < files (in the order given) < CLI values, whatever their position on the line, and
  pydantic validates the result once.
- A key that matches no option is a `UserError` naming the source and the closest valid key; no user
  mistake escapes as another exception.
- The schema (`schema()`) is walked once per model and shared by lookups, suggestions and `--help`.
- Nothing here knows a program's option names: what a program adds (other spellings of a key, messages for
  options it lacks, options meant for another program, sections that settings alone do not switch on, the
  environment prefix) comes in as a `Dialect`. asyncrl's is in `loader.py`.

Why not a published parser: `loader.py`'s docstring says (pydantic-settings, prime-pydantic-config).
"""

from __future__ import annotations

import ast
import difflib
import functools
import json
import tomllib
import types
import typing
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

from asyncrl.core.errors import UserError

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


# ---------------------------------------------------------------- what a program adds


def plain_unknown(model: type[BaseModel], flag: str) -> str:
    """The message for `--flag` that names no option: the flag and the closest valid key."""
    return f"unknown option --{flag}{suggest(model, flag.replace('-', '_'))}"


@dataclass(frozen=True)
class Dialect:
    """A program's additions to the grammar (the defaults add nothing).

    `rename(model, key)`: the key a snake_case dotted key stands for (aliases, older spellings).
    `unknown(model, flag)`: the error for `--flag` that names no option.
    `foreign(model, key)`: the option `--key` names in another program's config, accepted and ignored here
    (None: not one).
    `settings_only`: section -> the keys that configure it without switching it on.
    `env_prefix`: environment variables read as options (`PREFIX_A__B`).
    """

    rename: Callable[[type[BaseModel], str], str] = lambda model, key: key
    unknown: Callable[[type[BaseModel], str], str] = plain_unknown
    foreign: Callable[[type[BaseModel], str], Leaf | None] = lambda model, key: None
    settings_only: Mapping[str, set[str]] = field(default_factory=dict)
    env_prefix: str = "APP_"


def resolve(model: type[BaseModel], dotted: str, dialect: Dialect) -> Leaf | None:
    """The option 'a.b-c' names (dashes or underscores, or another spelling the dialect knows); None if unknown."""
    return schema(model).get(dialect.rename(model, dotted.replace("-", "_")))


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


def mark_switched_on(source: dict, settings_only: Mapping[str, set[str]]) -> dict:
    """In one source (before merging): mark each settings-only section it gives bare (`{}`)."""
    out = {}
    for key, value in source.items():
        if isinstance(value, dict):
            value = (
                {SWITCHED_ON: True} if key in settings_only and not value else mark_switched_on(value, settings_only)
            )
        out[key] = value
    return out


def settle_switches(raw: dict, settings_only: Mapping[str, set[str]]) -> dict:
    """Drop the marks; a settings-only section holding only its settings, never switched on, is off (absent)."""
    out = {}
    for key, value in raw.items():
        if isinstance(value, dict):
            switched = value.get(SWITCHED_ON, False)
            value = settle_switches({k: v for k, v in value.items() if k != SWITCHED_ON}, settings_only)
            if key in settings_only and value and set(value) <= settings_only[key] and not switched:
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


def from_env(model: type[BaseModel], environ: Mapping[str, str], dialect: Dialect) -> dict:
    """PREFIX_A__B=v -> {'a': {'b': v}}; names that match no option are errors, an empty section enables it."""
    out: dict = {}
    prefix = dialect.env_prefix
    for name in sorted(n for n in environ if n.startswith(prefix)):
        dotted = ".".join(part.lower() for part in name[len(prefix) :].split("__"))
        leaf = resolve(model, dotted, dialect)
        if leaf is None:
            raise UserError(f"environment variable {name} matches no option{suggest(model, dotted)} (unset it)")
        raw = environ[name]
        set_path(out, leaf.path, {} if leaf.is_section and not raw.strip() else parse_value(leaf, raw))
    return _from_env_aliases(model, environ, out)


def _from_env_aliases(model: type[BaseModel], environ: Mapping[str, str], out: dict) -> dict:
    """The model's own environment variables (`env_aliases`: NAME -> option), under the prefixed ones: an
    empty value sets nothing; a value the option cannot take is a UserError naming the variable."""
    for name, dotted in getattr(model, "env_aliases", {}).items():
        raw = environ.get(name, "").strip()
        leaf = schema(model)[dotted]
        if not raw or get_path(out, leaf.path) is not None:
            continue
        try:
            checked = TypeAdapter(typing.Annotated[leaf.annotation, leaf.info])
            value = checked.validate_python(parse_value(leaf, raw))
        except ValidationError:
            flag = f"--{dotted.replace('_', '-')}"
            raise UserError(f"environment variable {name}={raw!r} is not a valid {flag}") from None
        set_path(out, leaf.path, value)
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


def parse_argv(model: type[BaseModel], argv: list[str], dialect: Dialect, passthrough: bool = False) -> ParsedArgs:
    """Split argv into config files, CLI values and (optionally) unknown flags to pass through."""
    out, tokens = ParsedArgs(), deque(argv)
    while tokens:
        tok = tokens.popleft()
        if tok in ("-h", "--help"):
            continue  # answered before parsing, by the caller (cli.parse_or_exit)
        if tok == "--dry-run":
            out.dry_run = True
        elif tok.startswith("@"):
            out.files.append(((), tok[1:] or _value(tokens, "@")))
        elif tok.startswith("--"):
            _option(model, tok, tokens, out, passthrough, dialect)
        else:
            raise UserError(f"unexpected argument {tok!r}: options start with --, config files with '@ '")
    return out


def _flag(model: type[BaseModel], key: str, dialect: Dialect) -> tuple[Leaf | None, bool]:
    """(option, negated) for `--key`: `--no-x` negates a boolean or an optional section x."""
    leaf = resolve(model, key, dialect)
    if leaf is not None or not key.startswith("no-"):
        return leaf, False
    leaf = resolve(model, key[3:], dialect)
    if leaf is not None and not (leaf.is_bool or (leaf.is_section and leaf.optional)):
        raise UserError(f"--{key}: --no- only applies to on/off options, and {key[3:]} is not one")
    return leaf, leaf is not None


def _option(
    model: type[BaseModel], tok: str, tokens: deque[str], out: ParsedArgs, passthrough: bool, dialect: Dialect
) -> None:
    """Consume one `--key[=value]` (and its value, if it takes one) into `out`."""
    key, eq, inline = tok[2:].partition("=")
    value = inline if eq else None
    leaf, negated = _flag(model, key, dialect)
    other = dialect.foreign(model, key) if leaf is None else None
    if other is not None:  # another program's option: its value is consumed, and ignored here
        if value is None and not other.is_bool and not other.is_section:
            _value(tokens, f"--{key}")
        return
    if leaf is None and not passthrough:
        raise UserError(dialect.unknown(model, key))
    if leaf is None:  # kept for the program to pass on, with its value if one follows
        out.passthrough.append(tok)
        if value is None and tokens and not tokens[0].startswith("--"):
            out.passthrough.append(tokens.popleft())
    elif negated:
        set_path(out.cli, leaf.path, None if leaf.is_section else False)
    elif leaf.is_section:
        _section(leaf, key, value, tokens, out, dialect)
    elif leaf.is_bool:
        set_path(out.cli, leaf.path, value if value is not None else _bool_word(tokens))
    else:
        set_path(out.cli, leaf.path, parse_value(leaf, value if value is not None else _value(tokens, f"--{key}")))


def _bool_word(tokens: deque[str]) -> bool:
    """A following 'true'/'false' is the flag's value (consumed); a bare flag means True."""
    if tokens and tokens[0].lower() in ("true", "false"):
        return tokens.popleft().lower() == "true"
    return True


def _section(leaf: Leaf, key: str, value: str | None, tokens: deque[str], out: ParsedArgs, dialect: Dialect) -> None:
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
    elif follows is not None and follows.lstrip().startswith("{"):  # --section "{'key': 8}"
        set_path(out.cli, leaf.path, parse_value(leaf, tokens.popleft()))
    else:  # merges with values set elsewhere on the line
        section = dict(get_path(out.cli, leaf.path) or {})
        if leaf.path[-1] in dialect.settings_only:
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


def validate(model: type[BaseModel], data: dict, dialect: Dialect):
    """The merged dict as a `model`; a validation error is a one-line UserError."""
    try:
        return model.model_validate(settle_switches(data, dialect.settings_only))
    except ValidationError as err:
        raise UserError(format_validation_error(err)) from None


def collect_raw(
    model: type[BaseModel], argv: list[str], environ: Mapping[str, str], dialect: Dialect, passthrough: bool = False
) -> tuple[dict, ParsedArgs]:
    """Merge env < files (in order) < CLI into one raw dict (not yet validated)."""
    args = parse_argv(model, argv, dialect, passthrough=passthrough)
    marked = functools.partial(mark_switched_on, settings_only=dialect.settings_only)
    raw = marked(from_env(model, environ, dialect))
    for scope, path in args.files:
        raw = deep_merge(raw, marked(load_file(model, path, scope)))
    return deep_merge(raw, marked(args.cli)), args
