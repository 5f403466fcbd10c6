"""The SLURM templates (`scripts/slurm/*.sbatch`): valid bash, and under a fake `srun` / `scontrol` they
start the right command on the right host with the right ranks, and every asyncrl command line they
build resolves (`--dry-run` of the real entrypoint). A missing required variable is a one-line error
before anything starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SLURM = REPO / "scripts" / "slurm"
# ignores the SIGTERM a template sends its servers at the end: a recording is never cut short
SRUN = """#!/usr/bin/env bash
trap '' TERM
exec python3 - "$@" <<'PY'
import json, os, sys
keep = ("INFERENCE_SERVER_API_KEY", "INFERENCE_SERVER_IP", "OUTPUT_DIR")
with open(os.environ["SRUN_RECORD"], "a") as f:
    f.write(json.dumps({"argv": sys.argv[1:], "env": {k: os.environ.get(k) for k in keep}}) + "\\n")
PY
"""
SCONTROL = '#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && printf "%s\\n" $FAKE_HOSTS\n'


def sbatch(template: str, tmp_path: Path, hosts: list[str], *args: str, **env: str) -> tuple[int, str, list[dict]]:
    """Run a template as SLURM would on `hosts` (srun only records); (exit code, stderr, srun calls)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    record = tmp_path / "srun.jsonl"
    record.unlink(missing_ok=True)
    base = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SRUN_RECORD": str(record), "FAKE_HOSTS": " ".join(hosts)}
    base |= {"SLURM_SUBMIT_DIR": str(REPO), "SLURM_JOB_NODELIST": "fake[1-9]", "SLURM_GPUS_ON_NODE": "8"}
    base |= {"ASYNCRL_VENV": str(Path(sys.executable).parents[1]), "HOME": str(tmp_path)}
    done = subprocess.run(["bash", str(SLURM / template), *args], env=base | env, capture_output=True, text=True)
    calls = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
    return done.returncode, done.stderr, calls


def split(call: dict) -> tuple[str, list[str]]:
    """(host, command) of one recorded srun call."""
    flags = [a for a in call["argv"] if a.startswith("--")][:4]
    host = next(a.split("=", 1)[1] for a in flags if a.startswith("--nodelist="))
    return host, call["argv"][len(flags) :]


def resolves(cmd: list[str]) -> None:
    """The asyncrl part of `cmd` (after torchrun's -m, or the entrypoint itself) passes its own --dry-run."""
    if "-m" in cmd:
        module, args = cmd[cmd.index("-m") + 1], cmd[cmd.index("-m") + 2 :]
    else:
        module, args = f"asyncrl.entrypoints.{Path(cmd[0]).name}", cmd[1:]
    done = subprocess.run([sys.executable, "-m", module, *args, "--dry-run"], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, (cmd, done.stderr[-2000:])


@pytest.mark.parametrize("template", sorted(p.name for p in SLURM.glob("*.sbatch")))
def test_templates_are_valid_bash(template):
    assert subprocess.run(["bash", "-n", str(SLURM / template)]).returncode == 0


def test_multi_node_rl_places_servers_trainers_and_the_orchestrator(tmp_path):
    hosts = ["n1", "n2", "n3", "n4"]
    code, err, calls = sbatch(
        "rl_multi_node.sbatch", tmp_path, hosts, OUTPUT_DIR=str(tmp_path / "out"), INFERENCE_NODES="2"
    )
    assert code == 0, err
    by_host: dict[str, list[list[str]]] = {}
    for call in calls:
        host, cmd = split(call)
        by_host.setdefault(host, []).append(cmd)
        assert call["env"]["INFERENCE_SERVER_IP"] == "n1" and call["env"]["OUTPUT_DIR"] == str(tmp_path / "out")
        resolves(cmd)
    (head,), (second,) = by_host["n1"], by_host["n2"]
    key = calls[0]["env"]["INFERENCE_SERVER_API_KEY"]
    assert len(key) == 32 and head[head.index("--api-key") + 1] == key  # the orchestrator reads it from the env
    assert head[head.index("--data-parallel-size") + 1] == "16" and "--headless" not in head
    assert second[-3:] == ["--data-parallel-start-rank", "8", "--headless"]
    trainers = {h: next(c for c in by_host[h] if "torchrun" in c[0]) for h in ("n3", "n4")}
    assert [t[t.index("--node-rank") + 1] for t in trainers.values()] == ["0", "1"]
    assert {t[t.index("--rdzv-endpoint") + 1] for t in trainers.values()} == {"n3:29500"}
    assert all(t[t.index("--nnodes") + 1] == "2" for t in trainers.values())
    (orch,) = [c for c in by_host["n3"] if c[0].endswith("orchestrator")]
    assert orch[orch.index("--client.base-url") + 1] == "http://n1:8000/v1"
    assert "--num-train-workers" not in orch  # it reads the trainer's world size from OUTPUT_DIR


def test_single_node_rl_sft_and_eval(tmp_path):
    out = str(tmp_path / "out")
    code, err, calls = sbatch(
        "rl_single_node.sbatch", tmp_path, ["g1"], OUTPUT_DIR=out, CONFIG="examples/reverse_text/rl.toml",
        INFERENCE_GPU_IDS="[0]", TRAINER_GPU_IDS="[1,2]",
    )  # fmt: skip
    assert code == 0, err
    ((host, cmd),) = [split(c) for c in calls]
    assert host == "g1" and cmd[cmd.index("--trainer-gpu-ids") + 1] == "[1,2]"
    resolves(cmd)

    code, err, calls = sbatch(
        "sft.sbatch", tmp_path, ["s1", "s2"], OUTPUT_DIR=out, CONFIG="examples/reverse_text/sft.toml"
    )
    assert code == 0, err
    ranks = [split(c) for c in calls]
    assert sorted((h, c[c.index("--node-rank") + 1]) for h, c in ranks) == [("s1", "0"), ("s2", "1")]
    assert all(c[c.index("--rdzv-endpoint") + 1] == "s1:29500" for _, c in ranks)
    resolves(ranks[0][1])

    code, err, calls = sbatch(
        "eval.sbatch", tmp_path, ["e1"], OUTPUT_DIR=out, CONFIG="configs/eval/math.toml", MODEL="/m"
    )
    assert code == 0, err
    server, evaluation = sorted((split(c)[1] for c in calls), key=lambda c: c[0].endswith("eval"))
    assert server[server.index("--model.name") + 1] == "/m" and evaluation[0].endswith("/eval")
    assert evaluation[evaluation.index("--client.base-url") + 1] == "http://127.0.0.1:8000/v1"
    resolves(server)
    resolves(evaluation)


@pytest.mark.parametrize(
    ("template", "env", "says"),
    [
        ("rl_multi_node.sbatch", {}, "OUTPUT_DIR: set OUTPUT_DIR"),
        ("rl_multi_node.sbatch", {"OUTPUT_DIR": "o", "INFERENCE_NODES": "2"}, "2 node(s) but INFERENCE_NODES=2"),
        ("rl_multi_node.sbatch", {"OUTPUT_DIR": "o", "CONFIG_DIR": "nowhere"}, "error: nowhere/infer.toml not found"),
        ("sft.sbatch", {"OUTPUT_DIR": "o"}, "CONFIG: set CONFIG to an sft config"),
        ("eval.sbatch", {"OUTPUT_DIR": "o", "ASYNCRL_VENV": "/no/venv"}, "no asyncrl environment at /no/venv"),
    ],
)
def test_a_missing_setting_is_one_line_before_anything_starts(tmp_path, template, env, says):
    code, err, calls = sbatch(template, tmp_path, ["h1", "h2"], **env)
    assert code != 0 and says in err and len(err.strip().splitlines()) == 1, err
    assert calls == []
