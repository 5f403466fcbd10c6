"""The `rl` launcher: start inference, orchestrator and trainer as child processes and supervise them.

Each child gets its resolved config as a TOML file under `{output_dir}/configs/`, runs in its own process
group (so torchrun's workers die with it), and writes `{output_dir}/logs/<component>.log` itself; the
launcher adds `<component>.stdout` with whatever a child prints. The trainer's console is streamed, and
the launcher prints one line per step from the orchestrator's metrics (`tailer`) and, on a terminal, a live
progress bar under them (then the trainer's console goes through a pipe, so nothing draws over it). Which GPUs
or threads each child gets is `placement`'s; where files go is `transport.layout`'s. Before any child
starts, batches and weights an earlier attempt left past the start step are removed. If any child dies,
the others are stopped and the launcher names the dead one with what it logged in this attempt (its logs
are appended to across attempts: what an earlier one wrote is not this one's error).

With `[teacher]` (on-policy distillation) rl starts a second server the same way (`logs/teacher.log`, its own
port, checked free before it starts) and supervises it like the inference server: its death stops the run.
It only scores: weight updates go to the orchestrator's client server alone, never to the teacher.

Invariants: nothing rl started outlives it. SIGTERM, SIGHUP (a closed terminal) and Ctrl-C stop the run the
same way (exit 130); each child dies with rl however rl ends, SIGKILL included (`process.spawn`), and rl
adopts what its children leave behind (`reap_orphans`, e.g. an env server whose orchestrator was stopped),
so it stops those too before it exits.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import tomli_w
from loguru import logger

from asyncrl.config.cli import to_toml
from asyncrl.config.inference import SERVER_ROLE_VAR, InferenceConfig
from asyncrl.config.rl import RLConfig
from asyncrl.core import failpoint
from asyncrl.core.errors import FULL_HINT, LOW_SPACE_BYTES, UserError
from asyncrl.launcher.placement import Placement
from asyncrl.launcher.restart import ComponentDied, Restarts
from asyncrl.launcher.tailer import StepTailer
from asyncrl.launcher.watch import CollapseWatch
from asyncrl.launcher.zygote import Zygote, start_zygote
from asyncrl.transport.files import write_text_atomic
from asyncrl.transport.layout import RunLayout, resolve_resume_step
from asyncrl.utils import runstate
from asyncrl.utils.monitor import drop_rows_from
from asyncrl.utils.process import (
    PIPED,
    ChildExited,
    answers,
    copy_lines,
    exit_words,
    free_port,
    last_error_line,
    process_tree,
    reap_orphans,
    resume_stopped,
    spawn,
    stop_descendants,
    stop_groups,
    tail,
    telling_tail,
    wait_for_http,
)
from asyncrl.utils.progress import Bar

HEALTH_TIMEOUT_S = 900.0
SERVERS = ("inference", "teacher")  # children that serve until rl stops them
STOP_GRACE_S = 10.0
SUPERVISE_POLL_S = 0.2  # how soon a child's exit (the run's end) is seen; each poll is a few stat() calls
QUIET_S = 120.0  # no step for this long: say what the run is doing (the orchestrator's last log line)


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    stdout_path: Path
    log_path: Path
    layout: RunLayout  # the run dir its files are under
    run: str | None = None  # multi-run: the run this orchestrator serves
    since: dict[Path, int] | None = None  # where this attempt's lines start in its logs (by byte)
    started: float = field(default_factory=time.time)

    @property
    def record(self) -> Path:
        """Its run record (`utils.runstate`): a run's orchestrator's is `orchestrator.pid` in the run's own dir."""
        return self.layout.pid_file("orchestrator" if self.run else self.name)

    def error(self) -> str | None:
        """The error this attempt's process recorded on its way out (its run record's first line; a streamed
        trainer logs it nowhere else), else the last error line of its log in this attempt."""
        record = runstate.read(self.record)
        if record.get("error") and record.get("started", 0.0) >= self.started:
            return record["error"].splitlines()[0]
        return last_error_line(self.log_path, (self.since or {}).get(self.log_path, 0))

    def logged(self) -> list[str]:
        """`path:\n    lines` of each log this child wrote to in this attempt: its errors and its last lines."""
        out = []
        for path in (self.log_path, self.stdout_path):
            start = (self.since or {}).get(path, 0)
            if path.exists() and path.stat().st_size > start:
                out.append(f"{path}:\n{telling_tail(path, prefix='    ', start=start)}")
        return out


class Launcher:
    def __init__(self, config: RLConfig, layout: RunLayout, zygote: Zygote | None = None):
        self.config = config
        self.layout = layout
        self.zygote = zygote  # forks the Python children warm (`zygote`); None: each is exec'd
        self.placement = Placement(config)
        self.children: list[Child] = []
        self.runs = config.run_orchestrators()  # multi-run: each run's orchestrator config; empty: one run
        self.tailers: dict[str | None, StepTailer] = {}  # by run (None: the single run); start() sets their steps
        for run in self.runs or [None]:
            self.tailers[run] = self._tailer(run, 0)
        total = sum(c.max_steps or 0 for c in self.runs.values()) if self.runs else config.trainer.max_steps
        self.bar = Bar("rl", total or None)
        self.last_news = self.last_step = time.monotonic()
        self.up: set[str] = set()  # servers that answered their /health
        self.start_step = 0  # the step this attempt starts at (a single run)

    def _tailer(self, run: str | None, start: int) -> StepTailer:
        """Follows a run's training steps (a line each) and watches them for the signs of collapse."""
        layout = self.of(run)
        watch = CollapseWatch(layout.metrics_file("trainer"), label=run)
        return StepTailer(layout.metrics_file("orchestrator"), start, label=run, watch=watch)

    def of(self, run: str | None) -> RunLayout:
        """Run `run`'s dir (multi-run), or the run's own (None)."""
        return self.layout.run(run) if run is not None else self.layout

    # ------------------------------------------------------------ start

    def _write_configs(self, start: int) -> dict[str, Path]:
        cfg = self.config
        cfg.orchestrator.num_train_workers = self.placement.data_ranks
        for ckpt in (cfg.trainer.ckpt, cfg.orchestrator.ckpt):  # both resume at the one step resolved here
            if ckpt is not None and ckpt.resume_step is not None:
                ckpt.resume_step = start
        configs = {"trainer": cfg.trainer, "orchestrator": cfg.orchestrator}
        if self.runs:  # the trainer serves the runs; each run's orchestrator and settings go to its own dir
            del configs["orchestrator"]
            cfg.trainer.max_concurrent_runs = cfg.trainer.max_concurrent_runs or len(self.runs)
            cfg.trainer.runs = list(self.runs)
            if cfg.trainer.ckpt is not None:
                cfg.trainer.ckpt.resume_step = None  # each run's own, in its run.toml
        if cfg.inference is not None:
            if cfg.inference.num_threads is None and cfg.inference.backend == "embedded":
                cfg.inference.num_threads = self.placement.server_threads
            adapters = len(self.runs) if self.runs else (1 if cfg.orchestrator.lora_name is not None else 0)
            if adapters and cfg.inference.backend == "vllm":
                rank, given = cfg.trainer.model.lora.rank, cfg.inference.vllm_args
                cfg.inference.vllm_args += vllm_lora_flags(given, rank, cfg.trainer.max_concurrent_runs or adapters)
            if cfg.inference.allowed_weights_root is None:  # the trainer's weights are all under the run's dir
                cfg.inference.allowed_weights_root = Path(cfg.trainer.output_dir).resolve()
            configs["inference"] = cfg.inference
        if cfg.teacher is not None:
            if cfg.teacher.num_threads is None and cfg.teacher.backend == "embedded":
                cfg.teacher.num_threads = self.placement.teacher_threads
            configs["teacher"] = cfg.teacher
        self.layout.configs.mkdir(parents=True, exist_ok=True)
        paths = {}
        for name, sub in configs.items():
            path = self.layout.configs / f"{name}.toml"
            tmp = path.with_suffix(".toml.tmp")
            tmp.write_text(to_toml(sub))
            os.replace(tmp, path)
            paths[name] = path
        return paths

    def _prepare_runs(self, requested: int | None) -> dict[str, Path]:
        """Multi-run: each run's dir cleaned for its start step, its orchestrator config, then its run.toml
        (the trainer admits a run once that appears); returns each run's orchestrator config path."""
        specs, paths = {r.name: r for r in self.config.runs}, {}
        for name, orch in self.runs.items():
            run = RunLayout.for_config(orch)  # run_NAME/, its checkpoints by its own ckpt.path
            settings = specs[name].run_settings()
            start = 0 if requested is None else resolve_resume_step(run, requested, orch.max_steps)
            self._clean(run, start)
            for stale in (run.run_status, run.run_stop, run.run_config):  # how an earlier attempt ended
                stale.unlink(missing_ok=True)
            orch.num_train_workers = self.placement.data_ranks
            if requested is not None and orch.ckpt is not None:
                orch.ckpt.resume_step = start
                settings.setdefault("ckpt", {})["resume_step"] = start
            paths[name] = run.configs / "orchestrator.toml"
            write_text_atomic(paths[name], to_toml(orch))
            write_text_atomic(run.run_config, tomli_w.dumps(settings))
            self.tailers[name] = self._tailer(name, start)
            self.bar.done += start
        return paths

    def _clean(self, layout: RunLayout, start: int) -> None:
        """What an earlier attempt left past `start`: temp dirs, stale batches and weights, metrics rows (each
        process drops its own files' rows too, later; the tailer cannot wait for the orchestrator's)."""
        layout.remove_leftovers()
        layout.clear_stale(start)
        drop_rows_from(layout.metrics_file("orchestrator"), start)

    def _spawn(
        self, name: str, cmd: list[str], env: dict[str, str], stream: bool = False, run: str | None = None
    ) -> Child:
        layout = self.of(run)
        component = "orchestrator" if run is not None else name
        stdout_path, log_path = layout.log_file(component, ".stdout"), layout.log_file(component)
        logger.info(f"starting {name}: {' '.join(cmd)}")
        out = (PIPED if self.bar.enabled else None) if stream else stdout_path
        since = {p: p.stat().st_size if p.exists() else 0 for p in (stdout_path, log_path)}
        cores = self.placement.affinity(name)
        proc = (self.zygote and self.zygote.spawn(cmd, out, env, cores)) or spawn(cmd, out, env)
        child = Child(name, proc, stdout_path, log_path, layout, run, since)
        if out is PIPED:
            threading.Thread(target=copy_lines, args=(child.proc.stdout,), daemon=True).start()
        if cores is not None:  # right after exec, before its Python starts a thread (a forked child set it first)
            os.sched_setaffinity(child.proc.pid, cores)
            logger.info(f"{name} pinned to cores {cores}")
        self.children.append(child)
        return child

    def _orchestrator_env(self) -> dict[str, str]:
        """The placement's environment plus the API keys of the servers rl starts (`RLConfig.orchestrator_keys`)."""
        return {**self.placement.orchestrator_env(), **self.config.orchestrator_keys()}

    def _server_url(self) -> str:
        client = self.config.orchestrator.client
        return client.url.rstrip("/").removesuffix("/v1")

    def _teacher_url(self) -> str | None:
        """The teacher server's URL (no /v1): the one rl starts, else the orchestrator's; None: no distillation."""
        if self.config.teacher is not None:
            host = self.config.teacher.server.host
            return f"http://{'localhost' if host in ('0.0.0.0', '::', '') else host}:{self.config.teacher.server.port}"
        client = self.config.orchestrator.teacher
        return client.url.rstrip("/").removesuffix("/v1") if client is not None else None

    def _check_external_teacher(self) -> None:
        """`[orchestrator.teacher]` without `[teacher]`: rl starts no teacher, so one must answer already."""
        url = self._teacher_url()
        if url is not None and not answers(url + "/health"):
            raise UserError(
                f"no teacher server answers at {url}/health; start one (`inference --model.name TEACHER --server.port "
                "N`) or add a [teacher] section so rl starts it"
            )

    def _check_teacher_port(self) -> None:
        """The teacher's port must be free: a taken one would fail inside the server (or reach another's)."""
        server = self.config.teacher.server
        with socket.socket() as s:
            try:
                s.bind((server.host, server.port))
            except OSError as e:
                raise UserError(
                    f"the teacher server's port {server.port} on {server.host} is taken ({e.strerror}; by default "
                    "it is the inference server's port + 1): set a free one with --teacher.server.port"
                ) from None

    def _check_external_server(self) -> None:
        """Without an [inference] section rl starts no server: one must answer already."""
        url = self._server_url() + "/health"
        if not answers(url):
            raise UserError(
                f"no inference server answers at {url}; start one (`inference --model.name ...`) "
                "or add an [inference] section so rl starts it"
            )

    def _wait_for_server(self, name: str = "inference") -> None:
        """Until server `name` (inference, teacher) answers; a child that exits meanwhile is named (the run's
        orchestrators: later)."""
        if name in self.up:
            return
        base = self._server_url() if name == "inference" else self._teacher_url()
        url = base + "/health"
        self.bar.waiting(f"the {name} server at {base} (start, model load)")
        watched = {c.proc: c for c in self.children if c.run is None}
        try:
            waited = wait_for_http(url, HEALTH_TIMEOUT_S, list(watched), poll=0.1)
        except ChildExited as exited:
            self._died(watched[exited.proc])
        except TimeoutError:
            raise UserError(f"{name} server did not become healthy at {url} in {HEALTH_TIMEOUT_S:.0f}s") from None
        logger.info(f"{name} server is up at {base} ({waited:.0f}s)")
        self.up.add(name)

    def _wait_for_servers(self) -> None:
        self._wait_for_server("inference")
        if self.config.teacher is not None:
            self._wait_for_server("teacher")

    def _start_step(self) -> int:
        ckpt = self.config.trainer.ckpt
        if ckpt is None or ckpt.resume_step is None:
            return 0
        return resolve_resume_step(self.layout, ckpt.resume_step, self.config.trainer.max_steps)

    def _server_python(self, server: InferenceConfig) -> str:
        """The interpreter that runs `server`: vLLM's (this one, unless ASYNCRL_VLLM_PYTHON names another)."""
        if server.backend != "vllm":
            return sys.executable
        from asyncrl.utils.vllm_env import INSTALL_HINT, vllm_python

        python = vllm_python()
        if python is None:
            raise UserError(f"--inference.backend vllm needs a vLLM environment: {INSTALL_HINT}")
        return str(python)

    def _start_teacher(self, config_path: Path) -> None:
        """The teacher server: on the inference server's GPU only once that one has sized its memory."""
        teacher = self.config.teacher
        if self.placement.teacher_shares_gpu and "inference" in {c.name for c in self.children}:
            self._wait_for_server("inference")
        logger.info(f"teacher engine: {teacher.backend} ({teacher.backend_why}), model {teacher.model.name}")
        cmd = [self._server_python(teacher), "-m", "asyncrl.entrypoints.inference", "@", str(config_path)]
        self._spawn("teacher", cmd, {**self.placement.teacher_env(), SERVER_ROLE_VAR: "teacher"})

    def _trainer_cmd(self, config_path: Path) -> list[str]:
        cmd = ["-m", "asyncrl.entrypoints.trainer", "@", str(config_path)]
        ranks = self.placement.trainer_ranks
        if ranks > 1:
            torchrun = ["-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port"]
            cmd = torchrun + [str(free_port()), "--local-ranks-filter", "0"] + cmd
        return [sys.executable] + cmd

    def start(self) -> None:
        # a trainer that starts before the orchestrator's own clean-up could otherwise read a stale batch
        if spec := os.environ.get(failpoint.VAR):
            failpoint.parse(spec)  # a bad one: one line now, not a child's death later
        if self.config.teacher is not None:  # before any child starts
            self._check_teacher_port()
        ckpt = self.config.trainer.ckpt
        requested = ckpt.resume_step if ckpt is not None else None
        start, run_paths = 0, {}
        if self.runs:
            run_paths = self._prepare_runs(requested)
        else:
            start = self.start_step = self._start_step()
            self._clean(self.layout, start)
            self.tailers[None] = self._tailer(None, start)
            self.bar.done = start
        paths = self._write_configs(start)
        py, cfg = sys.executable, self.config
        if "inference" in paths:
            logger.info(f"inference engine: {self.config.inference.backend} ({self.config.inference.backend_why})")
            server = [self._server_python(cfg.inference), "-m", "asyncrl.entrypoints.inference"]
            self._spawn("inference", server + ["@", str(paths["inference"])], self.placement.inference_env())
        else:
            self._check_external_server()
        if "teacher" in paths:
            self._start_teacher(paths["teacher"])
        else:
            self._check_external_teacher()
        # the orchestrators wait for the server themselves; the trainer loads the model meanwhile unless it
        # shares a server's GPU (a GPU engine sizes its cache from the memory free when it starts)
        if self.placement.servers_share_trainer_gpu:
            self._wait_for_servers()
        orchestrators = run_paths or {None: paths["orchestrator"]}
        for run, path in orchestrators.items():
            name = "orchestrator" if run is None else f"orchestrator-{run}"
            cmd = [py, "-m", "asyncrl.entrypoints.orchestrator", "@", str(path)]
            self._spawn(name, cmd, self._orchestrator_env(), run=run)
        self._spawn("trainer", self._trainer_cmd(paths["trainer"]), self.placement.trainer_env(), stream=True)
        if not self.placement.servers_share_trainer_gpu:
            self._wait_for_servers()
        self.bar.waiting(f"step {self.bar.done}: its rollouts (the trainer loads the model meanwhile)")
        self.last_news = self.last_step = time.monotonic()

    # ------------------------------------------------------------ supervise

    def _died(self, child: Child) -> None:
        child = self._first_death(child)
        code = child.proc.returncode
        self.stop()
        error, said = child.error(), exit_words(code)
        raise ComponentDied(
            f"{child.name} died ({said}){self._disk_note()}; last lines of "
            + ("\n".join(child.logged()) or "its logs: (none in this attempt)"),
            child.name,
            code,
            said + (f": {error}" if error else ""),
        )

    def _first_death(self, child: Child) -> Child:
        """The run's dead child most likely the cause (the others may have died of its loss): one a signal
        killed, else one that crashed (any exit but 2), else `child` (exit 2: an error it reported)."""
        dead = [c for c in self.children if c.run is None and c.proc.poll() not in (None, 0)]
        return min(dead, key=lambda c: (c.proc.returncode >= 0, c.proc.returncode == 2), default=child)

    def _disk_note(self) -> str:
        """A process that died on a full disk often cannot even log why: say it here."""
        free = shutil.disk_usage(self.layout.root).free
        if free >= LOW_SPACE_BYTES:
            return ""
        return f": the disk holding {self.layout.root} is full ({free / 2**20:.1f} MiB free); {FULL_HINT}"

    def _show_progress(self) -> None:
        rows = [row for t in self.tailers.values() if (row := t.poll()) is not None]
        now = time.monotonic()
        if rows:
            self.last_news = self.last_step = now
            row, done = rows[-1], sum(t.next_step for t in self.tailers.values())
            fields = {"reward": row["reward/mean"], "off-policy": row.get("off_policy/level")}
            self.bar.update(done, **fields, **{"gen tok/s": row.get("perf/gen_tokens_per_s")})
        elif now - self.last_step > (self.config.stall_timeout or float("inf")):
            self._stalled(now - self.last_step)
        elif now - self.last_news > QUIET_S:
            self.last_news = now
            run = next(iter(self.runs), None)  # multi-run: the first run's orchestrator speaks for them
            last = tail(self.of(run).log_file("orchestrator"), lines=1).strip()
            self.bar.waiting(
                f"step {self.bar.done} (none for {QUIET_S:.0f}s; {self._suspects()}orchestrator's last line: {last})"
            )

    def _suspects(self) -> str:
        """`trainer is stopped (SIGSTOP), ` / `inference's log quiet for 300s, `: what may hold the run up."""
        said, now = [], time.time()
        for child in self.children:
            if child.proc.poll() is not None:
                continue
            if any(state in ("T", "t") for _, state in process_tree(child.proc.pid)):
                said.append(f"{child.name} is stopped (SIGSTOP)")
            elif child.log_path.exists() and now - child.log_path.stat().st_mtime > QUIET_S:
                said.append(f"{child.name}'s log quiet for {now - child.log_path.stat().st_mtime:.0f}s")
        return "".join(f"{s}, " for s in said)

    def _stalled(self, quiet: float) -> None:
        suspects = self._suspects().rstrip(", ") or "no process is stopped; see the logs"
        self.stop()
        raise ComponentDied(
            f"no step for {quiet:.0f}s (stall_timeout {self.config.stall_timeout:.0f}s): {suspects}; stopped the run "
            "(it resumes from its last checkpoint; raise --stall-timeout if steps are this slow)",
            "stall",
            None,
            f"no step for {quiet:.0f}s: {suspects}",
        )

    def supervise(self) -> None:
        finished: set[str] = set()
        while True:
            self._show_progress()
            for child in self.children:
                code = child.proc.poll()
                if code is None or child.name in finished:
                    continue
                finished.add(child.name)
                if code != 0 and child.run is None:
                    self._died(child)
                if code != 0:
                    self._run_lost(child, code)
                else:
                    logger.info(f"{child.name} finished")
            if self.runs:
                self._stop_ended_runs(finished)
            if {c.name for c in self.children if c.name not in SERVERS} <= finished:
                for t in self.tailers.values():
                    t.poll()
                return
            time.sleep(SUPERVISE_POLL_S)

    def _run_lost(self, child: Child, code: int) -> None:
        """Multi-run: a run's orchestrator died; the trainer ends that run (STOP) and the others go on."""
        error = runstate.read(child.record).get("error")
        why = f"its orchestrator died (exit code {code})" + (f": {error}" if error else "")
        write_text_atomic(child.layout.run_stop, why + "\n")
        logger.warning(
            f"run {child.run}: {why}; the run stops, the others go on. "
            "Last lines of " + ("\n".join(child.logged()) or "its logs: (none in this attempt)")
        )

    def _stop_ended_runs(self, finished: set[str]) -> None:
        """Multi-run: an orchestrator whose run the trainer ended (failed, stopped) would wait for weights forever."""
        for child in self.children:
            if child.run is None or child.name in finished or not child.layout.run_status.exists():
                continue
            if json.loads(child.layout.run_status.read_text()).get("state") != "done":
                stop_groups([child.proc], STOP_GRACE_S)
                runstate.close(child.record, runstate.STOPPED)
                finished.add(child.name)

    def run_outcomes(self) -> dict[str, dict]:
        """Multi-run: each run's run_status.json (how the trainer ended it)."""
        out = {}
        for name in self.runs:
            path = self.of(name).run_status
            out[name] = json.loads(path.read_text()) if path.exists() else {"state": "unknown", "step": None}
        return out

    def stop(self) -> None:
        running = [c for c in self.children if c.proc.poll() is None]
        for child in running:  # a stopped process (a torchrun rank too) would never act on SIGTERM
            resume_stopped(child.proc.pid)
        for proc in stop_groups([c.proc for c in self.children], STOP_GRACE_S):
            logger.warning(f"{next(c.name for c in self.children if c.proc is proc)} ignored SIGTERM; killed it")
        for child in running:  # their run records say rl stopped them (one that died keeps no exit: killed)
            runstate.close(child.record, runstate.STOPPED)
        spare = (self.zygote.proc.pid,) if self.zygote else ()
        if orphans := stop_descendants(STOP_GRACE_S, spare):  # what the children left (adopted: reap_orphans)
            logger.info(f"stopped {len(orphans)} process(es) the children left behind: pids {orphans}")

    def summary(self, elapsed: float) -> str:
        if not self.runs:
            return self.tailers[None].summary(elapsed, self.layout.weights)
        lines = []
        for name, outcome in self.run_outcomes().items():
            run = self.of(name)
            said = self.tailers[name].summary(elapsed, run.weights).removeprefix("[rl] ").removeprefix("done: ")
            lines.append(
                f"[rl {name}] {outcome['state']}: {said}" + (f" ({outcome['error']})" if outcome.get("error") else "")
            )
        return "\n".join(lines)


def launch(config: RLConfig, layout: RunLayout) -> None:
    """Run one RL experiment to completion (`layout`: its trainer's run), restarting it from its latest checkpoint
    when a process dies (`restart`); raises UserError naming a child that died and was not restarted."""
    start, restarts = time.monotonic(), Restarts(config, layout)

    def on_signal(signum, _frame):
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGHUP)}
    reap_orphans()
    zygote = start_zygote(str(layout.root), layout.log_file("zygote"), Placement(config).cuda)
    launcher = Launcher(config.model_copy(deep=True), layout, zygote)
    try:
        while (died := _attempt(launcher)) is not None:
            launcher = Launcher(restarts.next_config(died, launcher.start_step), layout, zygote)
        print(launcher.summary(time.monotonic() - start), flush=True)
        if said := restarts.summary():
            print(said, flush=True)
        if bad := {n: o for n, o in launcher.run_outcomes().items() if o["state"] != "done"}:
            said = "; ".join(
                f"{n} {o['state']} at step {o['step']}" + (f" ({o['error']})" if o.get("error") else "")
                for n, o in bad.items()
            )
            raise UserError(f"{len(bad)} of {len(launcher.runs)} runs did not finish: {said}; the others did")
    finally:
        launcher.stop()
        if zygote is not None:
            zygote.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _attempt(launcher: Launcher) -> ComponentDied | None:
    """Start and supervise one attempt of the run: None when it ended, else the death that ended it (the
    attempt's processes are stopped by then)."""
    try:
        with launcher.bar:
            launcher.start()
            launcher.supervise()
    except ComponentDied as died:
        return died
    return None


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM accepts


def vllm_lora_flags(given: list[str], rank: int, adapters: int = 1) -> list[str]:
    """What vLLM needs to serve runs' adapters (unless the user set it): LoRA on, a max rank that fits, room
    for `adapters` adapters in one batch."""
    flags = [] if "--enable-lora" in given else ["--enable-lora"]
    if "--max-lora-rank" not in given:
        flags += ["--max-lora-rank", str(next((r for r in VLLM_LORA_RANKS if r >= rank), rank))]
    if adapters > 1 and "--max-loras" not in given:
        flags += ["--max-loras", str(adapters)]
    return flags
