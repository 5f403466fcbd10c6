"""Where `rl`'s children run: GPU ids as CUDA_VISIBLE_DEVICES with CUDA, rank and thread counts without."""

import pytest

from asyncrl.config import loader
from asyncrl.config.rl import RLConfig, resolve_rl
from asyncrl.core.errors import UserError
from asyncrl.launcher.placement import Placement


def _config(*argv: str) -> RLConfig:
    raw, args = loader.collect_raw(RLConfig, ["--model.name", "m", *argv], {})
    return resolve_rl(raw, args)


def test_gpus_become_visible_devices(monkeypatch):
    monkeypatch.setenv("PYTHONSTARTUP", "x.py")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    place = Placement(_config("--inference-gpu-ids", "[0,1]", "--trainer-gpu-ids", "[2,3]"), cuda=True)
    assert place.trainer_ranks == 2
    assert place.inference_env()["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert place.trainer_env()["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert "CUDA_VISIBLE_DEVICES" not in place.orchestrator_env()  # the orchestrator needs no GPU of its own
    assert "PYTHONSTARTUP" not in place.trainer_env() and "OMP_NUM_THREADS" not in place.inference_env()


def test_gpu_ids_count_within_an_inherited_mask(monkeypatch):
    """PRIME-RL's second experiment on one node: CUDA_VISIBLE_DEVICES=2,3 rl ... uses GPUs 2 and 3."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    place = Placement(_config(), cuda=True)  # default ids: inference [0], trainer [1]
    assert place.inference_env()["CUDA_VISIBLE_DEVICES"] == "2"
    assert place.trainer_env()["CUDA_VISIBLE_DEVICES"] == "3"
    place = Placement(_config("--trainer-gpu-ids", "[1,2]"), cuda=True)
    with pytest.raises(UserError, match=r"GPU id 2 is outside CUDA_VISIBLE_DEVICES=2,3 \(2 GPUs visible\)"):
        place.trainer_env()


def _cores(monkeypatch, n: int) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("asyncrl.launcher.placement.usable_cores", lambda: list(range(n)))


def test_split_gives_the_server_half_the_cores_and_the_ranks_the_rest(monkeypatch):
    _cores(monkeypatch, 9)
    place = Placement(_config("--trainer-cpu-processes", "2"), cuda=False)
    assert place.trainer_ranks == 2 and place.trainer_env()["OMP_NUM_THREADS"] == "2"  # 5 cores over 2 ranks
    assert place.server_threads == 4 and place.affinity("inference") is None  # split: threads only
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert place.trainer_env()["OMP_NUM_THREADS"] == "3"  # the user's setting wins


def test_pinned_puts_server_and_trainer_on_disjoint_cores(monkeypatch):
    _cores(monkeypatch, 2)
    place = Placement(_config("--cpu-placement", "pinned"), cuda=False)
    assert place.affinity("inference") == [0] and place.affinity("trainer") == [1]
    assert place.affinity("orchestrator") is None and place.server_threads == 1
    assert place.trainer_env()["OMP_NUM_THREADS"] == "1"


def test_shared_gives_every_core_to_both(monkeypatch):
    _cores(monkeypatch, 4)
    place = Placement(_config("--cpu-placement", "shared"), cuda=False)
    assert place.server_threads == 4 and place.trainer_env()["OMP_NUM_THREADS"] == "4"
    assert place.affinity("trainer") is None


def test_cuda_leaves_threads_alone(monkeypatch):
    _cores(monkeypatch, 16)
    place = Placement(_config("--cpu-placement", "pinned"), cuda=True)
    assert place.server_threads is None and place.affinity("inference") is None
    assert "OMP_NUM_THREADS" not in place.trainer_env()


def test_bad_placement_is_a_one_line_error():
    with pytest.raises(UserError, match="cpu.placement|cpu_placement"):
        _config("--cpu-placement", "spread")


def test_vllm_gets_lora_flags_for_an_adapter_run_unless_set():
    from asyncrl.launcher.supervisor import vllm_lora_flags

    assert vllm_lora_flags([], 4) == ["--enable-lora", "--max-lora-rank", "8"]
    assert vllm_lora_flags([], 16) == ["--enable-lora", "--max-lora-rank", "16"]
    assert vllm_lora_flags(["--enable-lora", "--max-lora-rank", "64"], 16) == []


def test_tensor_parallel_ranks_share_their_rows(monkeypatch):
    _cores(monkeypatch, 4)
    place = Placement(_config("--trainer-cpu-processes", "2", "--trainer.model.tp", "2"), cuda=False)
    assert place.trainer_ranks == 2 and place.data_ranks == 1  # the orchestrator packs for one data rank
    with pytest.raises(UserError, match=r"tp = 2 does not divide the 3 trainer rank\(s\).*\(--trainer-cpu-processes\)"):
        Placement(_config("--trainer-cpu-processes", "3", "--trainer.model.tp", "2"), cuda=False)
