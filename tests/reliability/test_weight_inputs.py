"""Hostile weight dirs and LoRA adapters sent to the inference server (embedded engine, real files, real HTTP).

One server for the module, serving the tiny model from a dir laid out like a HF cache snapshot (every file a
symlink into a blobs dir) with `--allowed-weights-root` = a dir of this session's temp dir and
`--max-lora-adapters` 3. Each case sends a dir a hostile or careless client could
write: a file rewritten while the server reads it, index shards and symlinks that point out of the root,
malformed index and adapter configs, weights that are not weights (NaN, int32, scalars), adapter names
that are not names, one adapter too many. Every answer must be a one-line 4xx naming what is wrong, and
the server must then give the same greedy completion as before (its weights untouched).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))  # server_proc
from server_proc import client, start_server  # noqa: E402

pytestmark = [pytest.mark.reliability, pytest.mark.slow]

MAX_ADAPTERS = 3
BODY = {"messages": [{"role": "user", "content": "reverse: abcdef"}], "max_tokens": 6, "temperature": 0}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("weights_root").resolve()


@pytest.fixture(scope="module")
def outside(tmp_path_factory, served_model_dir) -> Path:
    """A valid weight dir (the base weights) outside the root."""
    out = tmp_path_factory.mktemp("outside").resolve()
    shutil.copy(served_model_dir / "model.safetensors", out / "model.safetensors")
    return out


@pytest.fixture(scope="module")
def linked_model_dir(tmp_path_factory, served_model_dir) -> Path:
    """The served model as a HF cache snapshot: snapshot/<file> -> ../blobs/<file>."""
    cache = tmp_path_factory.mktemp("hf_cache")
    shutil.copytree(served_model_dir, cache / "blobs")
    (cache / "snapshot").mkdir()
    for f in (cache / "blobs").iterdir():
        (cache / "snapshot" / f.name).symlink_to(Path("..") / "blobs" / f.name)
    return cache / "snapshot"


@pytest.fixture(scope="module")
def server(linked_model_dir, root):
    srv = start_server("embedded", linked_model_dir, allowed_weights_root=root, max_lora_adapters=MAX_ADAPTERS)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with client(server) as c:
        yield c


@pytest.fixture(scope="module")
def base(served_model_dir) -> dict[str, torch.Tensor]:
    return load_file(served_model_dir / "model.safetensors")


def answer(http, server) -> list:
    body = {**BODY, "model": server.model, "logprobs": True}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return [(c["token"], round(c["logprob"], 4)) for c in r.json()["choices"][0]["logprobs"]["content"]]


@pytest.fixture(scope="module")
def before(http, server) -> list:
    return answer(http, server)


def refused(r, status: int, param: str, *words: str) -> str:
    """The one-line error of a refused request; returns its message."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and "\n" not in err["message"], err
    for w in words:
        assert w in err["message"], err
    return err["message"]


def weight_dir(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    path.mkdir(parents=True)
    save_file(tensors, str(path / "model.safetensors"))
    return path


def adapter_dir(path: Path, base: dict, config: dict | None = None, tensors: dict | None = None) -> Path:
    """A PEFT adapter on layer 0's q_proj (rank 2), its config and tensors overridable."""
    w = base["model.layers.0.self_attn.q_proj.weight"]
    key = "base_model.model.model.layers.0.self_attn.q_proj"
    ab = {f"{key}.lora_A.weight": torch.randn(2, w.shape[1]), f"{key}.lora_B.weight": torch.randn(w.shape[0], 2)}
    path.mkdir(parents=True)
    save_file(ab if tensors is None else tensors, str(path / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"], "bias": "none"}
    (path / "adapter_config.json").write_text(json.dumps({**cfg, **(config or {})}))
    return path


def update(http, path: Path):
    return http.post("/update_weights", json={"weight_dir": str(path)})


def load_lora(http, name: str, path: Path):
    return http.post("/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})


# ---- 1: a weight file rewritten while the server reads it ------------------------------------------------------
REWRITE = """
import os, sys, time
path, half, parent = sys.argv[1], int(sys.argv[2]), os.getppid()
data, cuts = open(path, "rb").read(), 0
with open(path, "r+b") as fh:
    while os.getppid() == parent:  # stops with the test, even one killed by SIGBUS
        fh.truncate(half)
        cuts += 1
        if cuts == 1:  # the test starts its updates on the first cut, not after a guessed delay
            print("cut", flush=True)
        time.sleep(0.01)
        fh.seek(half)
        fh.write(data[half:])
        fh.flush()
        time.sleep(0.005)
"""


def test_a_weight_file_rewritten_during_update_is_an_error_not_a_crash(http, server, root, base, before):
    """Old code kept the tensors memory-mapped until the engine copied them into the model: a file cut short
    meanwhile killed the server with SIGBUS. The file holds the base weights (a complete read loads them
    again); another process cuts it in half and writes the rest back, again and again."""
    d = weight_dir(root / "rewritten", base)
    f = d / "model.safetensors"
    args = [sys.executable, "-c", REWRITE, str(f), str(f.stat().st_size // 2)]
    writer = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline() == "cut\n"
        answers = [update(http, d) for _ in range(30)]
    finally:
        writer.kill()
        writer.wait()
    statuses = {r.status_code for r in answers}
    assert statuses <= {200, 400, 409} and statuses - {200}, statuses
    assert all("\n" not in r.json()["error"]["message"] for r in answers if r.status_code != 200)
    assert answer(http, server) == before


# ---- 3: index shards and symlinks out of the root --------------------------------------------------------------
def _indexed(path: Path, base: dict, shard: str) -> Path:
    path.mkdir(parents=True)
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": dict.fromkeys(base, shard)}))
    return path


def test_shards_and_files_outside_the_root_are_refused_alike(http, server, root, base, outside, before):
    rel = os.path.relpath(outside / "model.safetensors", root / "esc")
    messages = {}
    for i, shard in enumerate([rel, rel.replace("model.", "missing."), "/etc/passwd", "/etc/hostname"]):
        r = update(http, _indexed(root / f"esc{i}", base, shard))
        messages[shard] = refused(r, 403, "weight_dir", "not inside").replace(shard, "X").replace(f"esc{i}", "D")
    assert len(set(messages.values())) == 1, messages  # no existence oracle
    link = root / "link"
    link.mkdir()
    (link / "model.safetensors").symlink_to(outside / "model.safetensors")
    refused(update(http, link), 403, "weight_dir", "not inside")
    linked = _indexed(root / "link_index", base, "shard.safetensors")
    (linked / "shard.safetensors").symlink_to(outside / "model.safetensors")
    refused(update(http, linked), 403, "weight_dir", "not inside")
    adapter = adapter_dir(root / "link_adapter", base)
    (adapter / "adapter_model.safetensors").unlink()
    (adapter / "adapter_model.safetensors").symlink_to(outside / "model.safetensors")
    refused(load_lora(http, "linked", adapter), 403, "lora_path", "not inside")
    assert answer(http, server) == before and http.get("/v1/models").json()["data"][1:] == []


def test_the_servers_own_linked_checkpoint_still_reloads(http, server, before):
    """Shards are confined to the dirs clients name, not to the server's own checkpoint (HF cache links)."""
    assert http.post("/reload_weights", json={}).status_code == 200
    assert answer(http, server) == before


# ---- 5: malformed index files and adapter configs --------------------------------------------------------------
@pytest.mark.parametrize(
    "index",
    [["model.safetensors"], {"weight_map": {"model.embed_tokens.weight": 3}}, {"weight_map": ["model.safetensors"]}],
    ids=["a-list", "non-string-shard", "weight_map-a-list"],
)
def test_a_malformed_index_is_400(http, root, index, request):
    d = root / f"index-{request.node.callspec.id}"
    d.mkdir()
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    refused(update(http, d), 400, "weight_dir", "weight_map")


@pytest.mark.parametrize(
    "config, field",
    [
        ({"lora_alpha": "16"}, "lora_alpha"),
        ({"lora_alpha": {"a": 1}}, "lora_alpha"),
        ({"alpha_pattern": ["q_proj"]}, "alpha_pattern"),
        ({"alpha_pattern": {"q_proj": "x"}}, "alpha_pattern"),
        ({"target_modules": "q_proj(("}, "target_modules"),
        ({"r": 0}, "r must"),
    ],
    ids=["alpha-string", "alpha-dict", "alpha_pattern-list", "alpha_pattern-value", "bad-regex", "r-0"],
)
def test_a_malformed_adapter_config_is_400(http, root, base, config, field, request):
    d = adapter_dir(root / f"cfg-{request.node.callspec.id}", base, config)
    refused(load_lora(http, "bad-cfg", d), 400, "lora_path", field)


def test_scalar_and_empty_adapter_tensors_are_400(http, root, base):
    key = "base_model.model.model.layers.0.self_attn.q_proj"
    for name, a in (("scalar", torch.tensor(1.0)), ("empty", torch.zeros(0, 128))):
        tensors = {f"{key}.lora_A.weight": a, f"{key}.lora_B.weight": torch.zeros(128, 0)}
        d = adapter_dir(root / f"tensor-{name}", base, tensors=tensors)
        refused(load_lora(http, "bad-tensor", d), 400, "lora_path", "lora_A", "matrices")


# ---- 7: weights that are not weights ---------------------------------------------------------------------------
def test_nan_and_integer_weights_are_refused_model_untouched(http, server, root, base, before):
    name = "model.layers.0.mlp.down_proj.weight"
    nan = weight_dir(root / "nan", {**base, name: torch.full_like(base[name], float("nan"))})
    refused(update(http, nan), 400, "weight_dir", name, "NaN")
    ints = weight_dir(root / "int", {k: v.to(torch.int32) for k, v in base.items()})
    refused(update(http, ints), 400, "weight_dir", "int32")
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    adapter = adapter_dir(root / "nan_adapter", base)
    tensors = load_file(adapter / "adapter_model.safetensors")
    save_file({**tensors, key: torch.full_like(tensors[key], float("nan"))}, str(adapter / "adapter_model.safetensors"))
    refused(load_lora(http, "nan", adapter), 400, "lora_path", key, "NaN")
    assert answer(http, server) == before and http.get("/v1/models").json()["data"][1:] == []


# ---- 12: adapter names and how many adapters ----------------------------------------------------------------------
@pytest.mark.parametrize("name", ["a" * 10_000, "bad\x07name", "../../etc", ".hidden", "a..b", ""])
def test_an_adapter_name_that_is_not_a_name_is_400(http, root, base, name):
    d = root / "named"
    if not d.exists():
        adapter_dir(d, base)
    refused(load_lora(http, name, d), 400, "lora_name", "lora_name")


def test_loaded_adapters_are_capped(http, server, root, base, before):
    d = adapter_dir(root / "capped", base)
    for i in range(MAX_ADAPTERS):
        assert load_lora(http, f"run-{i}", d).status_code == 200
    refused(load_lora(http, "one-more", d), 409, "lora_name", "--max-lora-adapters")
    assert load_lora(http, "run-0", d).status_code == 200  # a new step under a loaded name still loads
    names = [m["id"] for m in http.get("/v1/models").json()["data"][1:]]
    assert names == [f"run-{i}" for i in range(MAX_ADAPTERS)]
    assert answer(http, server) == before
