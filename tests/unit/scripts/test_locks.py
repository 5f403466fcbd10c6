"""`uv sync` and scripts/setup.sh install the same pins: uv.lock agrees with requirements/cpu.lock (scripts/lock.sh
writes both), is up to date with pyproject.toml, names no path of the machine that wrote it, and a fresh clone's
`uv sync --locked` gives a working .venv."""

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pip_pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins[norm(name)] = version.split(";")[0].strip()
    return pins


def uv_lock() -> dict:
    return tomllib.loads((REPO / "uv.lock").read_text())


def uv_versions() -> dict[str, list[str]]:
    versions: dict[str, list[str]] = {}
    for package in uv_lock()["package"]:
        versions.setdefault(norm(package["name"]), []).append(package["version"])
    return versions


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


# an absolute path (after a quote, a space, `=` or `@`, or at a line's start) or a file: URL
LOCAL_PATH = re.compile(r"""file:|(?:^|[\s"'=@])/\w""", re.M)


def uv_binary() -> str | None:
    here = Path(sys.executable).parent / "uv"
    return str(here) if here.exists() else shutil.which("uv")


def test_uv_lock_has_every_cpu_lock_pin():
    pins = pip_pins(REPO / "requirements/cpu.lock")
    locked = uv_versions()
    assert len(pins) > 100
    moved = {name: (version, locked.get(name)) for name, version in pins.items() if locked.get(name) != [version]}
    assert not moved, f"uv.lock and requirements/cpu.lock disagree (run scripts/lock.sh): {moved}"


def test_uv_lock_torch_is_the_setup_pin():
    # scripts/setup.sh installs torch==2.13.0 (the CPU build where pip's find-links has it); uv.lock, PyPI's 2.13.0
    assert "torch==2.13.0" in (REPO / "scripts/setup.sh").read_text()
    (torch,) = [p for p in uv_lock()["package"] if p["name"] == "torch"]
    assert (torch["version"], torch["source"]) == ("2.13.0", {"registry": "https://pypi.org/simple"})
    assert "torch==2.13.0" in pyproject()["dependency-groups"]["dev"]


@pytest.mark.parametrize("lock", ["uv.lock", *sorted(p.name for p in (REPO / "requirements").glob("*.lock"))])
def test_no_lock_names_a_local_path(lock):
    # a path of the machine that wrote the lock (a find-links wheel, an editable checkout) fails everywhere else
    path = REPO / lock if lock == "uv.lock" else REPO / "requirements" / lock
    hits = [line.strip() for line in path.read_text().splitlines() if LOCAL_PATH.search(line)]
    assert not hits, f"{lock} names local paths (re-lock with scripts/lock.sh): {hits[:3]}"


def test_local_path_pattern():
    assert LOCAL_PATH.search('{ path = "/opt/wheels/torch.whl" }') and LOCAL_PATH.search("-e file:///src/x")
    assert LOCAL_PATH.search("x @ /tmp/x.whl") and LOCAL_PATH.search("--find-links /opt/wheels")
    assert not LOCAL_PATH.search('source = { editable = "environments/echo_twice" }')
    assert not LOCAL_PATH.search('{ url = "https://files.pythonhosted.org/packages/37/torch.whl" }')


def test_uv_sync_installs_every_environment():
    envs = {norm(p.name) for p in (REPO / "environments").iterdir() if (p / "pyproject.toml").exists()}
    project = pyproject()
    sources = project["tool"]["uv"]["sources"]
    assert envs <= {norm(n) for n in project["dependency-groups"]["dev"]}
    assert {norm(n) for n in sources} == envs
    assert all(sources[n]["editable"] and (REPO / sources[n]["path"]).is_dir() for n in sources)


def test_uv_version_is_the_installer_pin():
    version = re.search(r"^UV_VERSION=(\S+)$", (REPO / "scripts/installer.sh").read_text(), re.M).group(1)
    assert pyproject()["tool"]["uv"]["required-version"] == f">={version}"


def test_uv_lock_is_up_to_date(tmp_path):
    uv = uv_binary()
    if uv is None:
        pytest.skip("no uv here (scripts/setup.sh puts uv into .venv)")
    env = {**os.environ, "UV_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run(
        [uv, "lock", "--check", "--offline"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, f"uv.lock is stale (run scripts/lock.sh): {done.stderr[-2000:]}"


def _pypi_reachable() -> bool:
    import httpx

    try:
        return httpx.head("https://pypi.org/simple/", timeout=5).status_code < 500
    except httpx.HTTPError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("ASYNCRL_TEST_UV_SYNC") != "1", reason="opt-in: ASYNCRL_TEST_UV_SYNC=1")
def test_uv_sync_from_a_fresh_clone(tmp_path):
    """Minutes here (network: PyPI's wheels, torch's CUDA build among them, into an empty cache), too long for CI,
    so opt-in (ASYNCRL_TEST_UV_SYNC=1); CI checks the lock above instead."""
    uv = uv_binary()
    if uv is None or not _pypi_reachable():
        pytest.skip("needs uv and PyPI")
    changed = ["git", "-C", str(REPO), "status", "--porcelain", "pyproject.toml", "uv.lock"]
    if subprocess.run(changed, capture_output=True, text=True).stdout:
        pytest.skip("pyproject.toml or uv.lock has uncommitted changes (a clone would not see them)")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True, timeout=120)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UV_", "VIRTUAL_ENV", "PYTHONPATH"))}
    env["UV_CACHE_DIR"] = str(tmp_path / "cache")
    done = subprocess.run([uv, "sync", "--locked"], cwd=clone, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    python = clone / ".venv/bin/python"
    probe = "import asyncrl, torch, reverse_text, tool_calc; print(asyncrl.__file__, torch.__version__)"
    out = subprocess.run([python, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    where, version = out.stdout.split()
    assert where == str(clone / "src/asyncrl/__init__.py") and version.startswith("2.13.0")
    for script in ("rl", "sft", "eval", "evals"):
        helped = subprocess.run([clone / ".venv/bin" / script, "--help"], env=env, capture_output=True, timeout=120)
        assert helped.returncode == 0, (script, helped.stderr[-1000:])
