"""Run the Helm chart's three containers in a built image with plain Docker: the chart's commands, args and env.

What a cluster would run, minus the cluster: `helm template` with deploy/helm/examples/cpu.yaml and a tiny
local model, then one container per workload sharing a host dir as the claim (/data) and the rendered
ConfigMap as /config; inference and orchestrator share one network namespace of their own (no network beyond
it; the orchestrator dials the server at 127.0.0.1 through `orchestrator.baseUrl`), the trainer has none (it
talks to the others through files). Passes when the orchestrator and the trainer finish
their steps and the server served the trainer's weights.

    python deploy/docker/smoke_run.py --image asyncrl:cpu [--helm PATH] [--steps 3] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "asyncrl"
KEY = "smoke-test-key"


def sh(*cmd: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=True, text=True, capture_output=True, **kw)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--image", default="asyncrl:cpu")
    p.add_argument("--helm", default="helm")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--timeout", type=float, default=900)
    a = p.parse_args()
    work = a.workdir or Path(tempfile.mkdtemp(prefix="asyncrl-smoke-"))
    data, config = work / "data", work / "config"
    data.mkdir(parents=True, exist_ok=True)
    config.mkdir(exist_ok=True)
    repo, tag = a.image.rsplit(":", 1)
    run = f"smoke{int(time.time())}"

    values = {
        "image": {"repository": repo, "tag": tag, "pullPolicy": "Never"},
        "model": "/data/tiny",
        "apiKey": {"value": KEY},
        "orchestrator": {"baseUrl": "http://127.0.0.1:8000/v1", "waitForInference": 600},
        "config": {
            "trainer": f"max_steps = {a.steps}\nmax_async_level = 1\n[data]\nseq_len = 256\n[optim]\nlr = 3e-4\n",
            "orchestrator": (
                f"max_steps = {a.steps}\nmax_async_level = 1\nseq_len = 256\nbatch_size = 32\n"
                'rollouts_per_example = 8\n[sampling]\nmax_tokens = 16\n[[env]]\nid = "reverse-text"\n'
            ),
            "inference": "max_batch_size = 64\n",
        },
    }
    (work / "values.yaml").write_text(yaml.safe_dump(values))
    rendered = sh(
        a.helm,
        "template",
        run,
        str(CHART),
        "-f",
        str(ROOT / "deploy/helm/examples/cpu.yaml"),
        "-f",
        str(work / "values.yaml"),
    ).stdout
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
    for name, text in cm["data"].items():
        (config / name).write_text(text)

    # the tiny model, built by the image itself onto the "claim"
    sh("docker", "run", "--rm", "--network", "none", "-v", f"{data}:/data", a.image, "asyncrl-tiny-model", "/data/tiny")

    def container(kind: str, component: str) -> tuple[dict, dict]:
        labels = lambda d: d["metadata"]["labels"]  # noqa: E731
        (w,) = [d for d in docs if d["kind"] == kind and labels(d)["app.kubernetes.io/component"] == component]
        spec = w["spec"]["template"]["spec"]
        return spec["containers"][0], spec

    names = []

    def start(component: str, c: dict, network: list[str], command: list[str] | None = None) -> str:
        env = {"NODE_RANK": "0"}
        for e in c.get("env", []):
            env[e["name"]] = e.get("value", KEY if "secretKeyRef" in e.get("valueFrom", {}) else "0")
        expand = lambda s: re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), s)  # noqa: E731
        cmd = command or [*c["command"], *c["args"]]
        name = f"{run}-{component}"
        args = [
            "docker",
            "run",
            "-d",
            "--name",
            name,
            *network,
            "-v",
            f"{data}:/data",
            "-v",
            f"{config}:/config:ro",
            "--shm-size",
            "2g",
        ]
        for k, v in env.items():
            args += ["-e", f"{k}={v}"]
        sh(*args, c["image"], *[expand(x) for x in cmd])
        names.append(name)
        return name

    try:
        inf, _ = container("Deployment", "inference")
        server = start("inference", inf, ["--network", "none"])
        orch, orch_spec = container("Job", "orchestrator")
        wait = orch_spec["initContainers"][0]
        start("wait", wait, ["--network", f"container:{server}"], wait["command"])
        assert sh("docker", "wait", f"{run}-wait", timeout=700).stdout.strip() == "0", "server never healthy"
        start("orchestrator", orch, ["--network", f"container:{server}"])
        trainer, _ = container("Job", "trainer")
        # files only (no network), and its own hostname resolvable, as a pod's is (/etc/hosts): torchrun needs it
        host = f"{run}-trainer-0"
        start("trainer", trainer, ["--network", "none", "--hostname", host, "--add-host", f"{host}:127.0.0.1"])
        codes = {}
        for component in ("orchestrator", "trainer"):
            codes[component] = sh("docker", "wait", f"{run}-{component}", timeout=a.timeout).stdout.strip()
        out_dir = data / f"{run}-asyncrl"  # the chart's default output dir: <mountPath>/<fullname>
        print(f"exit codes: {codes}; run dir {out_dir}")
        for component in ("inference", "orchestrator", "trainer"):
            logs = subprocess.run(["docker", "logs", f"{run}-{component}"], text=True, capture_output=True)
            tail = (logs.stdout + logs.stderr).strip().splitlines()[-8:]
            print(f"--- {component} (last lines)\n" + "\n".join(tail))
        metrics = (out_dir / "metrics" / "orchestrator.jsonl").read_text().splitlines()
        print(f"orchestrator steps: {len(metrics)}; last: {json.loads(metrics[-1]) if metrics else None}")
        status = sh("docker", "exec", server, "asyncrl", "status", f"/data/{out_dir.name}").stdout
        print(status)
        return 0 if codes == {"orchestrator": "0", "trainer": "0"} else 1
    finally:
        for name in names:
            subprocess.run(["docker", "rm", "-f", name], capture_output=True)


if __name__ == "__main__":
    sys.exit(main())
