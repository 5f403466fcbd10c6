"""The `rl` launcher: start inference, orchestrator and trainer as child processes and supervise them.

Each child gets its resolved config as a TOML file under `{output_dir}/configs/`, runs in its own process
group (so torchrun's workers die with it), and writes `{output_dir}/logs/<component>.log` itself; the
launcher adds `<component>.stdout` with whatever a child prints. The trainer's console is streamed, and
the launcher prints one line per step from the orchestrator's metrics. If any child dies, the others are
stopped and the launcher names the dead one with the end of its log.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from loguru import logger

from asyncrl.config.cli import to_toml
from asyncrl.config.rl import RLConfig
from asyncrl.transport.batch import rollouts_dir
from asyncrl.transport.weights import step_dirs
from asyncrl.utils.errors import UserError

HEALTH_TIMEOUT_S = 900.0
STOP_GRACE_S = 10.0


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    stdout_path: Path
    log_path: Path
    stdout_file: object | None = field(default=None, repr=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - a broken torch just means "no CUDA" for placement
        return False


def _tail(path: Path, lines: int = 20) -> str:
    if not path.exists():
        return "(no log)"
    text = path.read_text(errors="replace").rstrip().splitlines()
    return "\n".join("    " + line for line in text[-lines:]) or "(empty)"


class Launcher:
    def __init__(self, config: RLConfig):
        self.config = config
        self.out = Path(config.trainer.output_dir)
        self.children: list[Child] = []
        self.cuda = _cuda_available()
        self.metrics_pos = 0
        self.rewards: list[tuple[int, float]] = []

    # ------------------------------------------------------------ start

    def _write_configs(self) -> dict[str, Path]:
        cfg = self.config
        cfg.orchestrator.num_train_workers = self.trainer_ranks
        configs = {"trainer": cfg.trainer, "orchestrator": cfg.orchestrator}
        if cfg.inference is not None:
            configs["inference"] = cfg.inference
        paths = {}
        cfg_dir = self.out / "configs"
        cfg_dir.mkdir(parents=True, exist_ok=True)
        for name, sub in configs.items():
            path = cfg_dir / f"{name}.toml"
            tmp = path.with_suffix(".toml.tmp")
            tmp.write_text(to_toml(sub))
            os.replace(tmp, path)
            paths[name] = path
        return paths

    @property
    def trainer_ranks(self) -> int:
        return len(self.config.trainer_gpu_ids) if self.cuda else self.config.trainer_cpu_processes

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str], stream: bool = False) -> Child:
        logs = self.out / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        stdout_path = logs / f"{name}.stdout"
        sink = None if stream else open(stdout_path, "ab")
        logger.info(f"starting {name}: {' '.join(cmd)}")
        proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT if sink else None,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        child = Child(name, proc, stdout_path, logs / f"{name}.log", sink)
        self.children.append(child)
        return child

    def _env(self, gpu_ids: list[int] | None) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("PYTHONSTARTUP", None)
        if self.cuda and gpu_ids is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpu_ids)
        return env

    def _server_url(self) -> str:
        client = self.config.orchestrator.client
        return client.url.rstrip("/").removesuffix("/v1")

    def _wait_for_server(self, server: Child | None) -> None:
        url = self._server_url() + "/health"
        start = time.monotonic()
        while True:
            if server is not None and server.proc.poll() is not None:
                self._died(server)
            try:
                if httpx.get(url, timeout=2.0).status_code == 200:
                    logger.info(f"inference server is up at {self._server_url()} ({time.monotonic() - start:.0f}s)")
                    return
            except httpx.HTTPError:
                pass
            if server is None:
                raise UserError(
                    f"no inference server answers at {url}; start one (`inference --model.name ...`) "
                    "or add an [inference] section so rl starts it"
                )
            if time.monotonic() - start > HEALTH_TIMEOUT_S:
                raise UserError(f"inference server did not become healthy at {url} in {HEALTH_TIMEOUT_S:.0f}s")
            time.sleep(0.5)

    def _clear_stale_batches(self) -> None:
        """Remove rollout batches an earlier run left at or after our start step, before any child runs.

        Otherwise a trainer that starts before the orchestrator's own clean-up could read one.
        """
        ckpt = self.config.trainer.ckpt
        start = 0
        if ckpt is not None and ckpt.resume_step is not None:
            from asyncrl.trainer.ckpt import resolve_resume_step

            start = resolve_resume_step(self.out, ckpt.resume_step, self.config.trainer.max_steps)
        for step, path in step_dirs(rollouts_dir(self.out)).items():
            if step >= start:
                shutil.rmtree(path, ignore_errors=True)

    def start(self) -> None:
        self._clear_stale_batches()
        paths = self._write_configs()
        py = sys.executable
        server = None
        if "inference" in paths:
            server_py = py
            if self.config.inference.backend == "vllm":  # vLLM lives in its own env (it conflicts with verifiers)
                from asyncrl.inference.vllm_launch import INSTALL_HINT, vllm_python

                server_py = vllm_python()
                if server_py is None:
                    raise UserError(f"--inference.backend vllm needs a vLLM environment: {INSTALL_HINT}")
            server = self._spawn(
                "inference",
                [str(server_py), "-m", "asyncrl.entrypoints.inference", "@", str(paths["inference"])],
                self._env(self.config.inference_gpu_ids),
            )
        self._wait_for_server(server)
        self._spawn(
            "orchestrator",
            [py, "-m", "asyncrl.entrypoints.orchestrator", "@", str(paths["orchestrator"])],
            self._env(None),
        )
        trainer_cmd = [py, "-m", "asyncrl.entrypoints.trainer", "@", str(paths["trainer"])]
        if self.trainer_ranks > 1:
            trainer_cmd = [
                py,
                "-m",
                "torch.distributed.run",
                "--nproc-per-node",
                str(self.trainer_ranks),
                "--master-port",
                str(_free_port()),
                "--local-ranks-filter",
                "0",
                "-m",
                "asyncrl.entrypoints.trainer",
                "@",
                str(paths["trainer"]),
            ]
        env = self._env(self.config.trainer_gpu_ids)
        if not self.cuda and "OMP_NUM_THREADS" not in env:
            # CPU: torch's default of one thread per core in every process oversubscribes the cores the
            # inference engine uses too, which makes both many times slower. Leave it a core.
            env["OMP_NUM_THREADS"] = str(max(1, ((os.cpu_count() or 2) - 1) // self.trainer_ranks))
        self._spawn("trainer", trainer_cmd, env, stream=True)

    # ------------------------------------------------------------ supervise

    def _died(self, child: Child) -> None:
        code = child.proc.returncode
        self.stop(exclude=child)
        logs = [f"{p}:\n{_tail(p)}" for p in (child.log_path, child.stdout_path) if p.exists() and p.stat().st_size]
        raise UserError(
            f"{child.name} died (exit code {code}); last lines of " + ("\n".join(logs) or "its logs: (none)")
        )

    def _report_steps(self) -> None:
        path = self.out / "metrics" / "orchestrator.jsonl"
        if not path.exists():
            return
        with open(path) as f:
            f.seek(self.metrics_pos)
            for line in f:
                if not line.endswith("\n"):
                    break
                self.metrics_pos += len(line.encode())
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if row.get("kind", "train") != "train" or "reward/mean" not in row or "step" not in row:
                    continue
                reward = row["reward/mean"]
                self.rewards.append((row["step"], reward))
                extras = "".join(
                    f"  {k.rsplit('/', 1)[-1]} {v:.3f}"
                    for k, v in row.items()
                    if k.startswith("metrics/") and k.endswith("exact_match")
                )
                print(
                    f"[rl] step {row['step']:>4}  reward {reward:.3f}{extras}  "
                    f"off-policy {row.get('off_policy/level', '?')}",
                    flush=True,
                )

    def supervise(self) -> None:
        finished: set[str] = set()
        while True:
            self._report_steps()
            for child in self.children:
                code = child.proc.poll()
                if code is None or child.name in finished:
                    continue
                if code != 0:
                    self._died(child)
                finished.add(child.name)
                logger.info(f"{child.name} finished")
            if {"trainer", "orchestrator"} <= finished:
                self._report_steps()
                return
            time.sleep(0.5)

    def stop(self, exclude: Child | None = None) -> None:
        alive = [c for c in self.children if c is not exclude and c.proc.poll() is None]
        for child in alive:
            try:
                os.killpg(child.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + STOP_GRACE_S
        for child in alive:
            try:
                child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning(f"{child.name} ignored SIGTERM; killing it")
                try:
                    os.killpg(child.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                child.proc.wait()
        for child in self.children:  # a torchrun worker that outlived its parent is still in the group
            try:
                os.killpg(child.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            if child.stdout_file is not None:
                child.stdout_file.close()
                child.stdout_file = None

    def summary(self, elapsed: float) -> str:
        if not self.rewards:
            return f"[rl] done in {elapsed:.0f}s (no reward logged)"
        first = self.rewards[: max(1, len(self.rewards) // 5)]
        last = self.rewards[-max(1, len(self.rewards) // 5) :]
        mean = lambda xs: sum(r for _, r in xs) / len(xs)  # noqa: E731
        return (
            f"[rl] done: {len(self.rewards)} steps in {elapsed:.0f}s; reward {mean(first):.3f} (first steps) -> "
            f"{mean(last):.3f} (last steps); weights in {self.out / 'weights'}"
        )


def launch(config: RLConfig) -> None:
    """Run one RL experiment to completion; raises UserError naming a child that died."""
    launcher = Launcher(config)
    start = time.monotonic()

    def on_signal(signum, _frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_signal)
    try:
        launcher.start()
        launcher.supervise()
        print(launcher.summary(time.monotonic() - start), flush=True)
    finally:
        launcher.stop()
        signal.signal(signal.SIGTERM, previous)
