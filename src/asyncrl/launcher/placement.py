"""Placement of the `rl` children: which GPUs or CPU cores and threads each one gets.

With CUDA, the inference server and the trainer each see only their configured GPU ids
(CUDA_VISIBLE_DEVICES; the ids count within the launcher's own CUDA_VISIBLE_DEVICES when it has one)
and the trainer runs one rank per GPU. Without CUDA the trainer runs
`trainer_cpu_processes` ranks and `cpu_placement` decides how it shares the cores with the embedded
inference engine:

- split: the server gets half the cores' worth of threads (at least one), the trainer's ranks the rest;
- pinned: the same thread counts, and each of the two runs on its own cores (CPU affinity);
- shared: both get one thread per core and the OS time-shares them.

A teacher server (`[teacher]`, on-policy distillation) runs on `teacher_gpu_ids` (default: the inference
server's GPUs; it starts once that server has sized its memory). On CPU it shares the server's cores with
half the server's threads (at least one): it only scores finished samples, a prefill each, so its load
comes in bursts between the server's generations; `pinned` pins it to the server's cores.

With `trainer.model.tp` (or `ep`) N the trainer's ranks must be a multiple of N (checked before any child starts);
the orchestrator packs for ranks / tp (`data_ranks`: the tp ranks of a tensor-parallel group read the same rows,
expert-parallel ranks each read their own).

The orchestrator is never pinned. A thread count the user set (`inference.num_threads`,
OMP_NUM_THREADS) always wins. Every child inherits the launcher's environment otherwise (minus
PYTHONSTARTUP).
"""

from __future__ import annotations

import os

from asyncrl.config.rl import RLConfig
from asyncrl.core.errors import UserError
from asyncrl.utils.cuda import cuda_available


def usable_cores() -> list[int]:
    """The cores this process may run on (all of them where affinity is not supported)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


class Placement:
    def __init__(self, config: RLConfig, cuda: bool | None = None):
        self.config = config
        self.cuda = cuda_available() if cuda is None else cuda
        self.mode = config.cpu_placement
        self.cores = usable_cores()
        shared = self.mode == "shared" or len(self.cores) == 1
        self.server_cores = self.cores if shared else self.cores[: max(1, len(self.cores) // 2)]
        self.trainer_cores = self.cores if shared else self.cores[len(self.server_cores) :]
        where = "trainer_gpu_ids" if self.cuda else "--trainer-cpu-processes"
        for what in ("tp", "ep"):
            n = getattr(config.trainer.model, what)
            if self.trainer_ranks % n:
                raise UserError(
                    f"trainer.model.{what} = {n} does not divide the {self.trainer_ranks} trainer rank(s): give the "
                    f"trainer a multiple of {n} ranks ({where}) or a trainer.model.{what} that divides them"
                )

    @property
    def trainer_ranks(self) -> int:
        return len(self.config.trainer_gpu_ids) if self.cuda else self.config.trainer_cpu_processes

    @property
    def data_ranks(self) -> int:
        """Trainer ranks that get different rows: the ranks of one tensor-parallel group share theirs."""
        return max(1, self.trainer_ranks // self.config.trainer.model.tp)

    @property
    def shares_gpu(self) -> bool:
        """Inference and trainer on one GPU: the trainer must start after the server has sized its memory."""
        return self.cuda and bool(set(self.config.inference_gpu_ids) & set(self.config.trainer_gpu_ids))

    @property
    def teacher_gpu_ids(self) -> list[int]:
        return self.config.teacher_gpu_ids or self.config.inference_gpu_ids

    @property
    def teacher_shares_gpu(self) -> bool:
        """Teacher and inference server on one GPU: the teacher starts after the server has sized its memory."""
        return self.cuda and bool(set(self.teacher_gpu_ids) & set(self.config.inference_gpu_ids))

    @property
    def servers_share_trainer_gpu(self) -> bool:
        """A server (inference or teacher) on a trainer GPU: the trainer starts after the servers are up."""
        teacher = self.teacher_gpu_ids if self.config.teacher is not None else []
        return self.shares_gpu or (self.cuda and bool(set(teacher) & set(self.config.trainer_gpu_ids)))

    @property
    def teacher_threads(self) -> int | None:
        """Embedded teacher engine threads on CPU (None with CUDA)."""
        return None if self.cuda else max(1, len(self.server_cores) // 2)

    @property
    def server_threads(self) -> int | None:
        """Embedded engine threads on CPU (None with CUDA: the engine's own default)."""
        return None if self.cuda else len(self.server_cores)

    def affinity(self, name: str) -> list[int] | None:
        """Cores child `name` is pinned to (None: not pinned)."""
        if self.cuda or self.mode != "pinned" or not hasattr(os, "sched_setaffinity"):
            return None
        return {"inference": self.server_cores, "teacher": self.server_cores, "trainer": self.trainer_cores}.get(name)

    def inference_env(self) -> dict[str, str]:
        return self._env(self.config.inference_gpu_ids)

    def teacher_env(self) -> dict[str, str]:
        return self._env(self.teacher_gpu_ids)

    def orchestrator_env(self) -> dict[str, str]:
        return self._env(None)

    def trainer_env(self) -> dict[str, str]:
        env = self._env(self.config.trainer_gpu_ids)
        if not self.cuda and "OMP_NUM_THREADS" not in env:
            # torch's default of one thread per core in every process oversubscribes the cores the
            # inference engine uses too; each rank gets its share of the trainer's cores
            env["OMP_NUM_THREADS"] = str(max(1, len(self.trainer_cores) // self.trainer_ranks))
        return env

    def _env(self, gpu_ids: list[int] | None) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("PYTHONSTARTUP", None)
        if self.cuda and gpu_ids is not None:
            env["CUDA_VISIBLE_DEVICES"] = visible_devices(gpu_ids, os.environ.get("CUDA_VISIBLE_DEVICES"))
        return env


def visible_devices(gpu_ids: list[int], inherited: str | None) -> str:
    """A child's CUDA_VISIBLE_DEVICES: `gpu_ids` index into the launcher's own mask when it has one
    (`CUDA_VISIBLE_DEVICES=2,3 rl ...` with ids [0] and [1] runs on GPUs 2 and 3, as in the PRIME-RL docs)."""
    if not inherited or not inherited.strip():
        return ",".join(str(g) for g in gpu_ids)
    mask = [d.strip() for d in inherited.split(",") if d.strip()]
    outside = [g for g in gpu_ids if g >= len(mask)]
    if outside:
        raise UserError(
            f"GPU id {outside[0]} is outside CUDA_VISIBLE_DEVICES={inherited} ({len(mask)} GPUs visible); "
            "inference_gpu_ids and trainer_gpu_ids count within it"
        )
    return ",".join(mask[g] for g in gpu_ids)
