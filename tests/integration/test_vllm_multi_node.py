"""PRIME-RL's multi-node inference, for real, on two network hosts: vLLM data parallelism over a veth link.

The head node (this network namespace, the link's .1 address) runs `inference --data-parallel-size 2
--data-parallel-size-local 1 --data-parallel-address HEAD_IP --data-parallel-rpc-port P`: the API
server and data-parallel rank 0. The second node (its own network namespace, .2; see `hosts.py`) runs the same
line plus `--data-parallel-start-rank 1 --headless`: rank 1's engine only, which connects to the head.
Both are started from the main environment's `inference` (vLLM installed in .venv), as the PRIME-RL docs
write them. Checked: requests are served by both ranks, /update_weights on the head reaches rank 1, and (it runs
without `--enable-lora`) /load_lora_adapter is a clear 400.

Needs root (ip netns), iproute2 and the vLLM env; skipped otherwise.
"""

import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from hosts import CAN_MAKE_HOSTS, WHY_NOT, network_host

from asyncrl.inference.vllm.launch import INSTALL_HINT, vllm_python
from asyncrl.utils.process import spawn, stop_groups, tail, wait_for_http

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(vllm_python() is None, reason=f"no vLLM env: {INSTALL_HINT}"),
    pytest.mark.skipif(not CAN_MAKE_HOSTS, reason=WHY_NOT),
]


@pytest.fixture(scope="module")
def second_host():
    with network_host("vllm-node1") as host:
        yield host


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    from asyncrl.utils.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("mn_models")
    # vLLM's CPU attention needs head_dim 32/64/...: hidden 128 / 4 heads; two seeds = two different models
    a = build_tiny_model(root / "a", hidden_size=128, num_layers=2, num_heads=4, seed=0)
    b = build_tiny_model(root / "b", hidden_size=128, num_layers=2, num_heads=4, seed=1)
    return a, b


@pytest.fixture(scope="module")
def cluster(second_host, model_dirs, tmp_path_factory):
    from asyncrl.utils.process import free_port

    out = tmp_path_factory.mktemp("mn_out")
    port, rpc = free_port(), free_port()
    line = [
        sys.executable, "-m", "asyncrl.entrypoints.inference", "--backend", "vllm",
        "--model.name", str(model_dirs[0]), "--model.dtype", "float32", "--model.enforce-eager",
        "--max-model-len", "256",
        "--data-parallel-size", "2", "--data-parallel-size-local", "1",
        "--data-parallel-address", second_host.peer, "--data-parallel-rpc-port", str(rpc),
    ]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOG_STATS_INTERVAL": "1"}  # per-engine stats each s
    head_env = {**env, "GLOO_SOCKET_IFNAME": second_host.peer_dev}
    node_env = {**env, "GLOO_SOCKET_IFNAME": second_host.dev}
    node_cmd = second_host.run([*line, "--data-parallel-start-rank", "1", "--headless"])
    logs = {"head": out / "head.log", "node": out / "node.log"}
    procs = [
        spawn([*line, "--server.port", str(port), "--output-dir", str(out / "head")], logs["head"], head_env),
        spawn([*node_cmd, "--output-dir", str(out / "node")], logs["node"], node_env),
    ]
    try:
        wait_for_http(f"http://{second_host.peer}:{port}/health", 300, procs[0])
        yield f"http://{second_host.peer}:{port}", logs
    except Exception:
        print(f"head:\n{tail(logs['head'], 40)}\nnode:\n{tail(logs['node'], 40)}")
        raise
    finally:
        stop_groups(procs)


def greedy_answers(url: str, model: str, n: int = 8) -> list[tuple[float, ...]]:
    """n identical greedy requests at once; each answer as its tokens' logprobs (a random tiny model's text
    is mostly newlines, its logprobs tell weights apart)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "abc"}],
        "max_tokens": 48,
        "temperature": 0,
        "logprobs": True,
    }
    with httpx.Client(timeout=120) as http, ThreadPoolExecutor(n) as pool:
        answers = list(pool.map(lambda _: http.post(f"{url}/v1/chat/completions", json=body), range(n)))
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    return [tuple(round(t["logprob"], 3) for t in a.json()["choices"][0]["logprobs"]["content"]) for a in answers]


def generated_by_rank_1(head_log) -> float:
    """Tokens/s the head's stats logger last reported for data-parallel rank 1 (the other host's engine)."""
    rates = re.findall(r"Engine 001: .*?generation throughput: ([\d.]+)", head_log.read_text())
    return max(map(float, rates), default=0.0)


def test_the_headless_node_serves_and_takes_weight_updates(cluster, model_dirs):
    url, logs = cluster
    model = str(model_dirs[0])
    assert "Launching 1 data parallel engine(s) in headless mode" in logs["node"].read_text()
    before = greedy_answers(url, model)
    assert len(set(before)) == 1  # greedy: the same text from either rank

    assert httpx.post(f"{url}/update_weights", json={"weight_dir": str(model_dirs[1])}, timeout=120).status_code == 200
    after = greedy_answers(url, model)
    # every request, on either node, now answers with the new weights (a rank left on the old ones would differ)
    assert len(set(after)) == 1 and after[0] != before[0]
    time.sleep(2)  # one stats interval
    assert generated_by_rank_1(logs["head"]) > 0  # the second host generated some of the answers
    node_log = logs["node"].read_text()
    assert "Reloading and processing weights" in node_log  # the update ran on the second host's worker


def test_a_server_without_enable_lora_refuses_adapters_in_one_line(cluster):
    """This server runs without `--enable-lora` (the session's shared vLLM server has it on)."""
    url, _ = cluster
    r = httpx.post(f"{url}/load_lora_adapter", json={"lora_name": "a", "lora_path": "/tmp"}, timeout=60)
    assert r.status_code == 400 and "--enable-lora" in r.json()["error"]["message"], r.text
