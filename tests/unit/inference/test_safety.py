"""An inference server others can reach: with `allowed_weights_root`, the training routes load nothing from
outside it (403, engine untouched); without an API key on an open address, startup warns loudly."""

from fastapi import FastAPI
from fastapi.testclient import TestClient

from asyncrl.config.inference import InferenceConfig
from asyncrl.inference.api import training
from asyncrl.inference.api.app import install_api
from asyncrl.inference.serving import warn_if_open


class FakeEngine:
    model_name = "m"

    def __init__(self):
        self.loaded: list[str] = []

    async def update_weights(self, weight_dir: str) -> None:
        self.loaded.append(weight_dir)

    async def reload_weights(self) -> None:
        self.loaded.append("base")

    async def load_lora_adapter(self, name: str, path: str) -> None:
        self.loaded.append(path)


def test_training_routes_load_only_under_the_allowed_root(tmp_path):
    run = tmp_path / "run"
    (run / "broadcast" / "step_1").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (run / "escape").symlink_to(tmp_path / "elsewhere")
    engine, app = FakeEngine(), FastAPI()
    install_api(app, engine, InferenceConfig(model={"name": "m"}, allowed_weights_root=run), [training.router])
    with TestClient(app) as http:
        assert http.post("/update_weights", json={"weight_dir": str(run / "broadcast" / "step_1")}).status_code == 200
        for bad in (tmp_path / "elsewhere", run / ".." / "elsewhere", run / "escape", "/etc"):
            r = http.post("/update_weights", json={"weight_dir": str(bad)})
            assert r.status_code == 403 and r.json()["error"]["type"] == "PermissionDeniedError", r.text
            assert "--allowed-weights-root" in r.json()["error"]["message"]
        r = http.post("/load_lora_adapter", json={"lora_name": "a", "lora_path": str(tmp_path / "elsewhere")})
        assert r.status_code == 403 and r.json()["error"]["param"] == "lora_path"
    assert engine.loaded == [str(run / "broadcast" / "step_1")]


def test_an_open_server_without_a_key_warns(caplog_loguru, tmp_path):
    warn_if_open(InferenceConfig(model={"name": "m"}))
    assert len(caplog_loguru) == 1 and "anyone who reaches port 8000" in caplog_loguru[0]
    for quiet in ({"api_key": "k"}, {"server": {"host": "127.0.0.1"}}):
        warn_if_open(InferenceConfig(model={"name": "m"}, **quiet))
    assert len(caplog_loguru) == 1
