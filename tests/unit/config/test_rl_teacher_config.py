"""`rl`'s `[teacher]` (on-policy distillation): how it resolves, what `--dry-run` shows, where it runs."""

from __future__ import annotations

import sys
import tomllib

import pytest

from asyncrl.config import loader
from asyncrl.config.rl import RLConfig, resolve_rl
from asyncrl.core.errors import UserError
from asyncrl.launcher.placement import Placement
from tests import warm


def rl(*argv: str) -> RLConfig:
    raw, args = loader.collect_raw(RLConfig, ["--model.name", "student", *argv], {})
    return resolve_rl(raw, args)


def test_teacher_gets_its_own_model_port_run_dir_and_context(tmp_path):
    cfg = rl(
        "--inference.server.port", "8100", "--teacher.model.name", "teacher", "--seq-len", "300",
        "--output-dir", str(tmp_path), "--log.level", "debug",
    )  # fmt: skip
    t = cfg.teacher
    assert t.model.name == "teacher" and cfg.inference.model.name == "student"  # the shared model is not its
    assert t.server.port == 8101  # the inference port + 1
    assert str(t.output_dir) == str(tmp_path) and t.log.level == "debug"  # logs/teacher.log in the run's logs
    assert t.model.max_model_len == 301  # it scores whole samples, and generates one token past them
    assert cfg.teacher_gpu_ids is None and cfg.inference.server.port == 8100


def test_teacher_port_follows_the_external_server_and_wins_when_set():
    assert rl("--orchestrator.client.port", "9000", "--teacher.model.name", "t").teacher.server.port == 9001
    assert rl("--inference", "--teacher.model.name", "t", "--teacher.server.port", "7000").teacher.server.port == 7000


def test_teacher_exp_id_puts_it_in_the_experiment_dir(tmp_path):
    cfg = rl("--inference", "--teacher.model.name", "t", "--output-dir", str(tmp_path), "--exp-id", "e1")
    assert str(cfg.teacher.output_dir) == str(tmp_path / "e1")


@pytest.mark.parametrize(
    "argv, said",
    [
        (["--teacher.server.port", "8000"], "teacher.server.port"),  # the inference server's
        (["--teacher.model.name", "t", "--teacher.model.max-model-len", "64"], "teacher.model.max_model_len"),
    ],
)
def test_teacher_mistakes_are_one_line_errors(argv, said):
    with pytest.raises(UserError, match=said.replace(".", r"\.")):
        rl("--inference", "--teacher.model.name", "t", "--seq-len", "128", *argv)


def test_teacher_needs_a_model_name():
    with pytest.raises(UserError, match=r"\[teacher.model\] name"):
        rl("--inference", "--teacher.server.port", "8005")


def test_no_teacher_no_teacher():
    cfg = rl("--inference")
    assert cfg.teacher is None
    assert cfg.orchestrator.teacher is None


def test_orchestrator_scores_with_the_teacher_rl_starts():
    cfg = rl("--inference.server.port", "8100", "--teacher.model.name", "t")
    assert cfg.orchestrator.teacher.port == 8101 and cfg.orchestrator.teacher.url == "http://localhost:8101/v1"
    cfg = rl("--inference", "--teacher.model.name", "t", "--teacher.server.host", "10.1.2.3")
    assert cfg.orchestrator.teacher.url == "http://10.1.2.3:8001/v1"


def test_two_teacher_ports_are_a_contradiction():
    with pytest.raises(UserError, match="contradicting teacher ports"):
        ports = ["--teacher.server.port", "85", "--orchestrator.teacher.port", "9"]
        rl("--inference", "--teacher.model.name", "t", *ports)


def test_a_base_url_the_user_set_wins():
    url = "http://10.0.0.9:8000/v1"
    cfg = rl("--inference", "--teacher.model.name", "t", "--orchestrator.teacher.base-url", url)
    assert cfg.orchestrator.teacher.url == url
    cfg = rl("--inference", "--orchestrator.teacher.base-url", url)  # only [orchestrator.teacher]: rl starts none
    assert cfg.teacher is None and cfg.orchestrator.teacher.url == url


def test_dry_run_shows_the_teacher(tmp_path):
    out = warm.run(
        [sys.executable, "-m", "asyncrl.entrypoints.rl", "--model.name", "s", "--inference", "--teacher.model.name",
         "t", "--output-dir", str(tmp_path), "--dry-run"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    shown = tomllib.loads(out.stdout)
    assert shown["teacher"]["model"]["name"] == "t" and shown["teacher"]["server"]["port"] == 8001
    assert shown["orchestrator"]["teacher"]["port"] == 8001


# ------------------------------------------------------------------ placement


def _cores(monkeypatch, n: int) -> None:
    monkeypatch.setattr("asyncrl.launcher.placement.usable_cores", lambda: list(range(n)))


def test_cpu_teacher_shares_the_server_cores_with_half_its_threads(monkeypatch):
    _cores(monkeypatch, 8)
    place = Placement(rl("--inference", "--teacher.model.name", "t"), cuda=False)
    assert place.server_threads == 4 and place.teacher_threads == 2
    assert place.trainer_env()["OMP_NUM_THREADS"] == "4"  # the trainer keeps its half
    _cores(monkeypatch, 2)
    place = Placement(rl("--inference", "--teacher.model.name", "t", "--cpu-placement", "pinned"), cuda=False)
    assert place.teacher_threads == 1 and place.affinity("teacher") == place.affinity("inference") == [0]


def test_gpu_teacher_defaults_to_the_inference_gpus(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    place = Placement(rl("--inference", "--teacher.model.name", "t"), cuda=True)
    assert place.teacher_env()["CUDA_VISIBLE_DEVICES"] == "0" and place.teacher_shares_gpu
    assert not place.servers_share_trainer_gpu and place.teacher_threads is None
    cfg = rl("--inference", "--teacher.model.name", "t", "--teacher-gpu-ids", "[2]", "--trainer-gpu-ids", "[1,2]")
    place = Placement(cfg, cuda=True)
    assert place.teacher_env()["CUDA_VISIBLE_DEVICES"] == "2" and not place.teacher_shares_gpu
    assert place.servers_share_trainer_gpu  # the trainer waits for the teacher to size its memory


def test_vllm_teacher_serves_on_all_its_gpus():
    raw = {"model": {"name": "s"}, "teacher": {"model": {"name": "t"}, "backend": "vllm"}, "teacher_gpu_ids": [2, 3]}
    from asyncrl.config.rl import vllm_data_parallel

    assert vllm_data_parallel(raw)["teacher"]["data_parallel_size"] == 2


def test_keys_of_the_servers_rl_starts_reach_the_orchestrator():
    """`[inference] api_key` / `[teacher] api_key`: the orchestrator gets each in the variable its client reads."""
    assert rl("--inference", "--teacher.model.name", "t").orchestrator_keys() == {}
    cfg = rl(
        "--inference.api-key", "k1", "--teacher.model.name", "t", "--teacher.api-key", "k2",
        "--orchestrator.teacher.api-key-var", "TEACHER_KEY",
    )  # fmt: skip
    assert cfg.orchestrator_keys() == {"OPENAI_API_KEY": "k1", "TEACHER_KEY": "k2"}
    same = rl("--inference.api-key", "k", "--teacher.model.name", "t", "--teacher.api-key", "k")
    assert same.orchestrator_keys() == {"OPENAI_API_KEY": "k"}
    elsewhere = rl("--inference.api-key", "k", "--orchestrator.client.base-url", "http://10.0.0.2:8000/v1")
    assert elsewhere.orchestrator_keys() == {}  # a server of the user's: its key is the user's business
    with pytest.raises(UserError, match=r"reads both from \$OPENAI_API_KEY.*api-key-var") as e:
        rl("--inference.api-key", "k1", "--teacher.model.name", "t", "--teacher.api-key", "k2")
    assert "\n" not in str(e.value)
