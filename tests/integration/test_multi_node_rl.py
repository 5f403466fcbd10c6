"""PRIME-RL's multi-node RL recipe, for real, across three network hosts (namespaces linked by veth pairs).

Host A runs the inference server with `--api-key $INFERENCE_SERVER_API_KEY`; host B (this namespace) runs
the orchestrator (`--client.base-url http://$INFERENCE_SERVER_IP:8000/v1 --client.api-key-var
INFERENCE_SERVER_API_KEY --output-dir $OUTPUT_DIR`) and trainer node 0; host C runs trainer node 1 — both
trainer nodes `torchrun --nnodes 2 --node-rank 0/1 --rdzv-endpoint B:PORT src/prime_rl/trainer/rl/train.py`
over gloo. `OUTPUT_DIR` is one directory all three see (the shared file system the PRIME-RL docs require). The
orchestrator is not told the trainer's world size: it reads what trainer rank 0 writes. Checked: every step
trains on both hosts, every batch is packed for 2 ranks, the server on A serves the trainer's weights of the
step before; a wrong API key, an unreachable server and a trainer node that dies each end with a clear error.
(That two ranks train as one does is exact in tests/integration/test_trainer_fsdp.py and test_sft.py; that
`rl` learns, in tests/integration/test_rl.py.)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from hosts import CAN_MAKE_HOSTS, WHY_NOT, network_host

from asyncrl.config import loader
from asyncrl.config.cli import to_toml
from asyncrl.config.rl import RLConfig, resolve_rl
from asyncrl.utils.process import free_port, spawn, stop_groups, tail, wait_for_http
from tests import warm
from tests.integration.test_rl import orchestrator_rows

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not CAN_MAKE_HOSTS, reason=WHY_NOT)]

REPO = Path(__file__).resolve().parents[2]
KEY = "multi-node-test-key"
PY = sys.executable


@pytest.fixture(scope="module")
def hosts():
    with network_host("infer") as a, network_host("node1") as c:
        yield a, c


@pytest.fixture(scope="module")
def server(hosts, warm_model, tmp_path_factory):
    """Host A's inference server (PRIME-RL's `inference ... --api-key $INFERENCE_SERVER_API_KEY`)."""
    a, _ = hosts
    root = tmp_path_factory.mktemp("infer")
    log = root / "inference.out"
    cmd = [PY, "-m", "asyncrl.entrypoints.inference", "--model.name", str(warm_model), "--model.max-model-len"]
    cmd += ["128", "--server.port", "8000", "--api-key", KEY, "--num-threads", "1", "--output-dir", str(root)]
    proc = spawn(a.run(cmd), log)
    try:
        wait_for_http(f"http://{a.ip}:8000/health", 300, proc, log)
        yield f"http://{a.ip}:8000/v1", log
    finally:
        stop_groups([proc])


def configs(out: Path, model: Path, steps: int) -> tuple[Path, Path]:
    """The trainer's and the orchestrator's TOML, as `rl` would resolve these flags (no num_train_workers)."""
    flags = ["--model.name", str(model), "--output-dir", str(out), "--max-steps", str(steps), "--seq-len", "128"]
    flags += ["--max-async-level", "1", "--trainer.optim.lr", "3e-4", "--trainer.optim.weight-decay", "0"]
    flags += ["--orchestrator.batch-size", "64", "--orchestrator.rollouts-per-example", "8"]
    flags += ["--orchestrator.sampling.max-tokens", "16", "--orchestrator.seed", "1", "--orchestrator.client.port", "1"]
    raw, args = loader.collect_raw(RLConfig, flags, {})
    cfg = resolve_rl(raw, args)
    assert cfg.orchestrator.num_train_workers is None
    out.mkdir(parents=True)
    (out / "trainer.toml").write_text(to_toml(cfg.trainer))
    (out / "orch.toml").write_text(to_toml(cfg.orchestrator))
    return out / "trainer.toml", out / "orch.toml"


def orchestrator(orch: Path, url: str, out: Path, key: str, *extra: str) -> list[str]:
    cmd = [PY, "-m", "asyncrl.entrypoints.orchestrator", "@", str(orch), "--client.base-url", url]
    return cmd + ["--client.api-key-var", "INFERENCE_SERVER_API_KEY", "--output-dir", str(out), *extra]


def trainer_node(rank: int, endpoint: str, trainer: Path, out: Path) -> list[str]:
    cmd = [PY, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(rank)]
    cmd += ["--rdzv-endpoint", endpoint, str(REPO / "src/prime_rl/trainer/rl/train.py"), "@", str(trainer)]
    return cmd + ["--output-dir", str(out)]


def start_run(hosts, server, warm_model, out: Path, steps: int):
    """Trainer node 1 on C, trainer node 0 and the orchestrator on B; their processes and logs."""
    _, c = hosts
    trainer, orch = configs(out, warm_model, steps)
    endpoint = f"{c.peer}:{free_port()}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "INFERENCE_SERVER_API_KEY": KEY}
    logs = {name: out / f"{name}.out" for name in ("node0", "node1", "orchestrator")}
    procs = {
        "node1": spawn(
            c.run(trainer_node(1, endpoint, trainer, out)), logs["node1"], env | {"GLOO_SOCKET_IFNAME": c.dev}
        ),
        "node0": spawn(
            trainer_node(0, endpoint, trainer, out), logs["node0"], env | {"GLOO_SOCKET_IFNAME": c.peer_dev}
        ),
        "orchestrator": warm.spawn(orchestrator(orch, server[0], out, KEY), logs["orchestrator"], env),
    }
    return procs, logs


def finish(procs: dict, logs: dict, timeout: float = 600) -> dict[str, int]:
    try:
        return {name: p.wait(timeout=timeout) for name, p in procs.items()}
    finally:
        stop_groups(list(procs.values()))


def test_three_hosts_train_and_weights_reach_the_server(hosts, server, warm_model, tmp_path):
    out = tmp_path / "shared"
    steps = 8
    procs, logs = start_run(hosts, server, warm_model, out, steps=steps)
    codes = finish(procs, logs)
    assert codes == {"node1": 0, "node0": 0, "orchestrator": 0}, {n: tail(p, 30) for n, p in logs.items()}
    assert json.loads((out / "trainer_world.json").read_text()) == {"world_size": 2}
    orch_log = (out / "logs" / "orchestrator.log").read_text()
    assert "packing batches for 2 trainer rank(s)" in orch_log  # learned, not configured
    rows = orchestrator_rows(out)
    assert [r["step"] for r in rows] == list(range(steps))
    trained = [json.loads(x) for x in (out / "metrics" / "trainer.jsonl").read_text().splitlines()]
    assert [r["step"] for r in trained] == list(range(steps))
    # the server on host A served the trainer's weights of the step before (async level 1)
    assert [r["policy/step"] for r in rows][2:] == [r["step"] - 1 for r in rows][2:]
    assert "world 2" in (out / "logs" / "trainer.log").read_text()  # one rank on each trainer host


def test_wrong_key_and_unreachable_server_are_one_line_errors(hosts, server, warm_model, tmp_path):
    a, _ = hosts
    _, orch = configs(tmp_path / "run", warm_model, 2)
    env = {**os.environ, "INFERENCE_SERVER_API_KEY": "not-the-key"}
    wrong = subprocess.run(
        orchestrator(orch, server[0], tmp_path / "run", "x"), capture_output=True, text=True, env=env
    )
    assert wrong.returncode == 2
    assert "refused the API key (401): $INFERENCE_SERVER_API_KEY holds a key the server refuses" in wrong.stderr
    nowhere = f"http://{a.ip[:-1]}9:8000/v1"  # an address on A's link that no host has
    cmd = orchestrator(orch, nowhere, tmp_path / "run", KEY, "--client.health-timeout", "3")
    gone = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert gone.returncode == 2 and f"inference server at {nowhere[:-3]} not reachable after 3s" in gone.stderr


def test_a_trainer_node_that_dies_stops_the_other_with_a_clear_error(hosts, server, warm_model, tmp_path):
    out = tmp_path / "shared"
    procs, logs = start_run(hosts, server, warm_model, out, steps=500)
    metrics = out / "metrics" / "trainer.jsonl"
    wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3, 300, logs)
    _, c = hosts
    pids = subprocess.run(["ip", "netns", "pids", c.netns], capture_output=True, text=True).stdout.split()
    for pid in pids:  # host C goes away: every process on it (torchrun's rank is not in its agent's group)
        os.kill(int(pid), signal.SIGKILL)
    code = procs["node0"].wait(timeout=180)
    stop_groups(list(procs.values()))
    assert code != 0
    said = logs["node0"].read_text()
    assert "error: trainer rank 0 lost contact with another rank (" in said, said[-3000:]  # e.g. Read error [C]:
    assert "[rank0]: Traceback" not in said  # a dead node is not a bug of ours (torchrun's own report follows)
    record = json.loads((out / "logs" / "trainer.pid").read_text())
    assert record["exit"] == 2 and "lost contact" in record["error"]  # what `asyncrl status` shows


def wait_for(done, timeout: float, logs: dict) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, {n: tail(p, 30) for n, p in logs.items()}
        time.sleep(0.2)
