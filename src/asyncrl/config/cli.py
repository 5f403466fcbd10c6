"""What every entrypoint does with its command line: --help, --dry-run, one-line errors, exit codes.

Invariants: a user mistake (`UserError`) prints one `error: ...` line on stderr and exits 2, never a
traceback; `--help` lists every option of the schema with its default; `--dry-run` prints TOML that
loads back into the same config (None is dropped: a None field always means its default).
"""

from __future__ import annotations

import signal
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import tomli_w
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from asyncrl.config import loader
from asyncrl.config.inference import chosen_backend
from asyncrl.core.errors import UserError, disk_full

T = TypeVar("T", bound=BaseModel)


def _type_name(leaf: loader.Leaf) -> str:
    inner = leaf.annotation
    origin = typing.get_origin(inner)
    if inner is bool:
        name = "BOOL"
    elif origin is typing.Literal:
        name = "|".join(str(a) for a in typing.get_args(inner))
    elif origin in (list, dict):
        name = origin.__name__.upper()
    elif isinstance(inner, type):
        name = {int: "INT", float: "FLOAT", str: "STR", Path: "PATH"}.get(inner, inner.__name__.upper())
    else:
        name = str(inner)
    return name + ("?" if leaf.optional else "")


def _default(field) -> str:
    if field.default is not PydanticUndefined:
        value = field.default
    elif field.default_factory is not None:
        value = field.default_factory()
    else:
        return "required"
    if isinstance(value, BaseModel):
        return "section"
    return repr(value) if not isinstance(value, Path) else str(value)


def _help_line(leaf: loader.Leaf) -> str:
    flag, desc = "--" + leaf.dotted.replace("_", "-"), leaf.info.description or ""
    if leaf.is_section:
        return f"  {flag:<44} [{'off unless set' if leaf.optional else 'section'}] {desc}"
    return f"  {flag + ' ' + _type_name(leaf):<44} {desc} (default: {_default(leaf.info)})"


def render_help(model: type[BaseModel], prog: str, summary: str) -> str:
    """Usage, the precedence of sources, then one line per option (sections included) with its default."""
    lines = [
        f"usage: {prog} [@ config.toml ...] [--key.subkey VALUE ...] [--dry-run]",
        "",
        summary,
        "",
        "Sources, highest precedence first: CLI flags > later @ files > earlier @ files > PRIME_A__B env > defaults.",
        "Booleans: --x / --no-x. Optional sections (default 'off'): --section enables with defaults,",
        "--section.key VALUE enables and sets, --no-section disables.",
        "",
        "options:",
        f"  {'--help':<44} show this message and exit",
        f"  {'--dry-run':<44} print the resolved config as TOML and exit",
    ]
    return "\n".join(lines + [_help_line(leaf) for leaf in loader.schema(model).values()])


def _plain(value: Any) -> Any:
    """Make a dumped config TOML-friendly: paths to str, None dropped (None means 'default/off')."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value if v is not None]
    if isinstance(value, Path):
        return str(value)
    return value


def to_toml(config: BaseModel) -> str:
    return tomli_w.dumps(_plain(config.model_dump(mode="python")))


def _quiet_broken_pipe() -> None:
    """`--help | head` should just stop, not print a traceback (only for these print-and-exit paths:
    a server must keep ignoring SIGPIPE)."""
    if hasattr(signal, "SIGPIPE"):
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)


def fail(message: str, code: int = 2) -> typing.NoReturn:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(code)


def parse_or_exit(
    model: type[T],
    prog: str,
    summary: str,
    argv: list[str] | None = None,
    resolve: Callable[[dict, loader.ParsedArgs], T] | None = None,
    passthrough: bool = False,
) -> T:
    """Parse argv (+ env) into `model`: handles --help / --dry-run and turns user errors into exit 2.

    `resolve(raw, args)` replaces plain validation when an entrypoint needs extra steps (rl's propagation).
    """
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        _quiet_broken_pipe()
        print(render_help(model, prog, summary))
        raise SystemExit(0)
    try:
        raw, args = loader.collect_raw(model, argv, passthrough=passthrough)
        raw = _pass_through(model, raw, args.passthrough)
        config = resolve(raw, args) if resolve else loader.validate(model, raw)
    except UserError as e:
        fail(str(e))
    if args.dry_run:
        _quiet_broken_pipe()
        sys.stdout.write(to_toml(config))
        raise SystemExit(0)
    return config


def _pass_through(model: type[BaseModel], raw: dict, unknown: list[str]) -> dict:
    """Append unknown flags to `vllm_args` when the backend is vLLM; otherwise the first is an error."""
    if not unknown:
        return raw
    if chosen_backend(raw) != "vllm":
        flag = unknown[0].removeprefix("--").split("=", 1)[0]
        raise UserError(
            f"{loader.unknown_option(model, flag)} (unknown flags are passed through to vLLM only, with --backend vllm)"
        )
    return loader.deep_merge(raw, {"vllm_args": raw.get("vllm_args", []) + unknown})


def run_guarded(fn: Callable[[], Any], finish: Callable[[int, str | None], None]) -> None:
    """Run an entrypoint body: user errors -> one line + exit 2; Ctrl-C -> exit 130. `finish(code, error)`
    is told how it ended, before the exit (the caller passes `utils.runstate.finish`: the run record)."""
    try:
        fn()
    except UserError as e:
        finish(2, str(e))
        fail(str(e))
    except KeyboardInterrupt:
        finish(130, "interrupted")
        print("interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    except SystemExit as e:
        finish(e.code if isinstance(e.code, int) else 1, None if not e.code else str(e.code))
        raise
    except BaseException as e:
        if (message := disk_full(e)) is not None:
            finish(2, message)
            fail(message)
        finish(1, f"{type(e).__name__}: {e}")
        raise
    finish(0, None)
