"""Placement of the `rl` children: which GPUs (or CPU threads) each one gets, expressed as its environment.

With CUDA, the inference server and the trainer each see only their configured GPU ids
(CUDA_VISIBLE_DEVICES) and the trainer runs one rank per GPU. Without CUDA the trainer runs
`trainer_cpu_processes` ranks and, unless OMP_NUM_THREADS is set, its ranks share all cores but one.
Every child inherits the launcher's environment otherwise (minus PYTHONSTARTUP).
"""

from __future__ import annotations

import os

from asyncrl.config.rl import RLConfig


def cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - a broken torch just means "no CUDA" for placement
        return False


class Placement:
    def __init__(self, config: RLConfig, cuda: bool | None = None):
        self.config = config
        self.cuda = cuda_available() if cuda is None else cuda

    @property
    def trainer_ranks(self) -> int:
        return len(self.config.trainer_gpu_ids) if self.cuda else self.config.trainer_cpu_processes

    def inference_env(self) -> dict[str, str]:
        return self._env(self.config.inference_gpu_ids)

    def orchestrator_env(self) -> dict[str, str]:
        return self._env(None)

    def trainer_env(self) -> dict[str, str]:
        env = self._env(self.config.trainer_gpu_ids)
        if not self.cuda and "OMP_NUM_THREADS" not in env:
            # torch's default of one thread per core in every process oversubscribes the cores the
            # inference engine uses too, which makes both many times slower. Leave it a core.
            env["OMP_NUM_THREADS"] = str(max(1, ((os.cpu_count() or 2) - 1) // self.trainer_ranks))
        return env

    def _env(self, gpu_ids: list[int] | None) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("PYTHONSTARTUP", None)
        if self.cuda and gpu_ids is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpu_ids)
        return env
