"""Chat templates sent in requests, rendered in a worker process bounded in time and memory.

A chat template is a program (jinja): one sent by a client can loop for minutes or build gigabyte strings
(`{% set x = 'a' * 2000000000 %}`), and jinja's sandbox bounds neither. So a request's template is refused
unless the server runs with `--trust-request-chat-template` (vLLM's flag, same meaning); when trusted it is
rendered by a `TemplateSandbox`: a child process (spawned, so it shares nothing with the engine), with its
address space capped at `MEMORY_MIB` above what it needs to start (RLIMIT_AS: a bigger allocation fails
there with a MemoryError), and a deadline of `TIMEOUT_S` per render, after which it is killed and a fresh one
is started for the next request. Overruns are a 400 on `chat_template`. The served model's own template is
trusted and rendered in the server (chat.py); only request templates come here.

`TemplatePool` holds `POOL_SIZE` sandboxes, each driven by a thread of its own: request templates wait for
one of them, never for the server's CPU thread (cpu.py), so a plain chat never waits behind a request's
template, however many bad ones are queued.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import queue
import resource
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from loguru import logger

from asyncrl.inference.api.errors import InvalidRequest

POOL_SIZE = 2  # sandboxes (processes) rendering request templates at once
TIMEOUT_S = 5.0
MEMORY_MIB = 512
START_TIMEOUT_S = 120.0  # the worker imports transformers' template code before its first render
FLAG = "--trust-request-chat-template"


class RequestTemplateError(InvalidRequest):
    def __init__(self, message: str):
        super().__init__(message, param="chat_template")


def refuse_untrusted() -> None:
    raise RequestTemplateError(f"chat templates sent in requests are refused; start the server with {FLAG}")


class TemplateSandbox:
    """One worker process rendering request templates, one render at a time (thread-safe, blocking)."""

    def __init__(self, timeout_s: float = TIMEOUT_S, memory_mib: int = MEMORY_MIB):
        self.timeout_s = timeout_s
        self.memory_mib = memory_mib
        self._lock = threading.Lock()
        self._proc: Any = None
        self._conn: Any = None

    def render(self, job: dict[str, Any]) -> str:
        """The rendered text of `job` (see `_render_job`); RequestTemplateError if it fails or overruns."""
        with self._lock:
            conn = self._ready_worker()
            conn.send(job)
            if not conn.poll(self.timeout_s):
                self._stop()
                raise RequestTemplateError(f"the request's chat template ran longer than {self.timeout_s:g} s")
            try:
                status, value = conn.recv()
            except (EOFError, OSError):
                self._stop()
                raise RequestTemplateError("the request's chat template crashed its worker") from None
            if status != "ok":
                if status == "memory":
                    self._stop()  # it exits after a MemoryError anyway
                raise RequestTemplateError(value)
            return value

    def start(self) -> None:
        """Start the worker now (it takes seconds), not at the first request that needs it."""
        with self._lock:
            self._ready_worker()

    def close(self) -> None:
        with self._lock:
            self._stop()

    def _ready_worker(self):
        if self._proc is not None and self._proc.is_alive():
            return self._conn
        self._stop()
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, self.memory_mib), name="asyncrl-template", daemon=True)
        self._proc.start()
        child.close()
        self._conn = parent
        if not parent.poll(START_TIMEOUT_S) or parent.recv() != "ready":
            self._stop()
            raise RuntimeError("the chat template worker did not start")
        logger.debug(f"chat template worker {self._proc.pid} started")
        return parent

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(5)
        if self._conn is not None:
            self._conn.close()
        self._proc, self._conn = None, None


class TemplatePool:
    """`size` sandboxes, each used by one thread of the pool's own: `await render(job)` from the event loop."""

    def __init__(self, size: int = POOL_SIZE, **sandbox_args: Any):
        self.sandboxes = [TemplateSandbox(**sandbox_args) for _ in range(size)]
        self._idle: queue.SimpleQueue = queue.SimpleQueue()
        for one in self.sandboxes:
            self._idle.put(one)
        self._threads = ThreadPoolExecutor(size, thread_name_prefix="asyncrl-template")

    async def render(self, job: dict[str, Any]) -> str:
        """`TemplateSandbox.render` in one of the pool's threads (a thread has a sandbox to itself)."""
        return await asyncio.get_running_loop().run_in_executor(self._threads, self._render, job)

    def _render(self, job: dict[str, Any]) -> str:
        sandbox = self._idle.get()
        try:
            return sandbox.render(job)
        finally:
            self._idle.put(sandbox)

    def start(self) -> None:
        """Start every sandbox's worker now, at once (each takes seconds)."""
        list(self._threads.map(TemplateSandbox.start, self.sandboxes))

    def close(self) -> None:
        for one in self.sandboxes:
            one.close()
        self._threads.shutdown(wait=False, cancel_futures=True)


_POOL: TemplatePool | None = None
_POOL_LOCK = threading.Lock()


def pool() -> TemplatePool:
    """The process' one pool of sandboxes (their workers start on first use, or at `start`)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = TemplatePool()
        return _POOL


# --- the worker process ---------------------------------------------------------------------------------


def _serve(conn, memory_mib: int) -> None:
    """The worker's loop: render each job it is sent; exit after a MemoryError or when the pipe closes."""
    from transformers.utils.chat_template_utils import render_jinja_template

    _cap_memory(memory_mib)
    conn.send("ready")
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        try:
            conn.send(("ok", _render_job(render_jinja_template, job)))
        except MemoryError:
            conn.send(("memory", f"the request's chat template needed more than {memory_mib} MiB"))
            return
        except Exception as e:  # jinja errors, raise_exception() in the template
            conn.send(("error", " ".join(f"cannot apply the request's chat template: {e}".split())))


def _render_job(render_jinja_template, job: dict[str, Any]) -> str:
    """What tokenizer.apply_chat_template(..., tokenize=False) renders, from the parts the server sends."""
    rendered, _ = render_jinja_template(
        conversations=[job["messages"]],
        tools=job["tools"],
        chat_template=job["chat_template"],
        add_generation_prompt=job["add_generation_prompt"],
        continue_final_message=job["continue_final_message"],
        **job["template_kwargs"],
    )
    return rendered[0]


def _cap_memory(memory_mib: int) -> None:
    """Cap this process' address space at what it maps now plus `memory_mib`."""
    with open("/proc/self/status") as f:
        vm_kib = next(int(line.split()[1]) for line in f if line.startswith("VmSize:"))
    limit = (vm_kib * 1024) + memory_mib * 1024 * 1024
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
