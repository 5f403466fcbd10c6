"""Console entrypoints, one thin module each: its main() is one call of `entry` with its config and its run.

`entry` is what every entrypoint does around its component: parse the command line into the config
(--help, --dry-run and a bad flag end here: config.cli), make the process's run layout from that config
(the one `RunLayout` of the process: `run(config, layout)` gets it and passes it down),
set up logging (and the run record `asyncrl status` reads) under it, run the component guarded (a user
error is one `error: ...` line and exit 2, Ctrl-C exit 130), and, where asked, write the run's report.

Invariants: a `locked` entrypoint (rl) takes its run dir's lock (`utils.runlock`) before it writes anything
there, a trainer, orchestrator or sft started on its own joins the dir (`runlock.join`) before it writes
anything there, and one that cannot is refused in one line; the report comes after `run_guarded`, so the run
record has its exit by then; a torchrun'd (`ranked`) entrypoint logs to one file per rank and reports on rank 0
only. It lives here, not in a sibling module, because the entrypoint modules never import one another
(.importlinter).

A process started as the command (`argv` None) ends as soon as its work is done (`_exit_now`): its threads
joined and its atexit handlers run (log sinks closed) as at any exit, its output flushed, then `os._exit` with the
exit code it would have had, skipping the interpreter's teardown of every module. With torch, transformers and
verifiers loaded that teardown took ~1 s of CPU (3-5 s on a busy machine) in every process of every run. An
exception other than SystemExit takes the usual way out (its traceback, exit 1).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import BaseModel

from asyncrl.config.base import LogConfig
from asyncrl.config.cli import fail, parse_or_exit, run_guarded
from asyncrl.core.errors import UserError
from asyncrl.transport.layout import RunLayout
from asyncrl.utils import runlock, runstate
from asyncrl.utils.logging import setup_logger, setup_rank_logger
from asyncrl.utils.process import die_with_parent

T = TypeVar("T", bound=BaseModel)


def entry(
    model: type[T],
    run: Callable[[T, RunLayout], Any],
    prog: str,
    summary: str,
    argv: list[str] | None = None,
    *,
    resolve: Callable[..., T] | None = None,
    passthrough: bool = False,
    run_of: Callable[[T], Any] = lambda config: config,
    log_of: Callable[[T], LogConfig] = lambda config: config.log,
    ranked: bool = False,
    reports: Callable[[T, RunLayout], list[RunLayout]] | None = None,
    locked: bool = False,
    component: str | None = None,
    joins: bool = False,
) -> None:
    """An entrypoint's main(): `run(config, layout)` for the `model` config that argv (+ env) gives.

    `resolve`, `passthrough`: as `parse_or_exit` takes them. `run_of(config)`: the config whose `output_dir`
    and `ckpt` are this process's run (rl: its trainer's); `log_of(config)`: its log settings. `ranked`: a
    torchrun'd component. `reports(config, layout)`: the runs to write a report of at the end, whatever the
    outcome (none if empty). `locked`: hold the run dir's lock for this process and its children (rl). `joins`:
    started on its own, join the dir (`runlock.join`; rank 0 of a torchrun'd one): the components that write
    a run's state (trainer, orchestrator, sft).
    `component`: the name of its log file and run record (default `prog`; rl's teacher server: `teacher`).
    """
    try:
        _entry(
            model,
            run,
            prog,
            summary,
            argv,
            resolve,
            passthrough,
            run_of,
            log_of,
            ranked,
            reports,
            locked,
            component,
            joins,
        )
    except SystemExit as e:
        if argv is None and (e.code is None or isinstance(e.code, int)):
            _exit_now(e.code or 0)
        raise
    if argv is None:
        _exit_now(0)


def _entry(
    model, run, prog, summary, argv, resolve, passthrough, run_of, log_of, ranked, reports, locked, component, joins
) -> None:
    config = parse_or_exit(model, prog, summary, argv, resolve=resolve, passthrough=passthrough)
    layout = RunLayout.for_config(run_of(config))
    try:
        if locked:
            runlock.hold(layout.root)
        elif joins and (not ranked or int(os.environ.get("RANK", "0")) == 0):
            runlock.join(layout.root, component or prog)
    except UserError as e:
        fail(str(e))
    if ranked and "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun rank: it dies with torchrun, however that ends
        die_with_parent(os.getppid())
    log = log_of(config)
    (setup_rank_logger if ranked else setup_logger)(component or prog, layout, log.level, log.file)
    try:
        run_guarded(lambda: run(config, layout), finish=runstate.finish)
    finally:
        if reports is not None and (not ranked or int(os.environ.get("RANK", "0")) == 0):
            _report(reports(config, layout))


def _exit_now(code: int) -> None:
    """Exit with `code` the way the interpreter would, less its module teardown: non-daemon threads joined
    (`threading._shutdown`, what the interpreter calls first; without it, the usual exit), atexit handlers run,
    stdout and stderr flushed."""
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is None:
        raise SystemExit(code)
    shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can reach it
            pass
    os._exit(code)


def _report(layouts: list[RunLayout]) -> None:
    if not layouts:
        return
    from asyncrl.report.report import report_at_end  # only a run that writes a report pays for its imports

    for layout in layouts:
        report_at_end(layout.root)
