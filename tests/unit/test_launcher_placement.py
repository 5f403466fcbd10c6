"""Where `rl`'s children run: GPU ids as CUDA_VISIBLE_DEVICES with CUDA, rank and thread counts without."""

from asyncrl.config import loader
from asyncrl.config.rl import RLConfig, resolve_rl
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


def test_cpu_ranks_share_all_cores_but_one(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 9)
    place = Placement(_config("--trainer-cpu-processes", "2"), cuda=False)
    assert place.trainer_ranks == 2 and place.trainer_env()["OMP_NUM_THREADS"] == "4"
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert place.trainer_env()["OMP_NUM_THREADS"] == "3"  # the user's setting wins
