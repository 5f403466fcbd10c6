"""The tripwire of the patch register (`asyncrl.core.patches`): one test per patched symbol.

Each fails when the installed library is outside the versions verified, or when the upstream code the patch
depends on is gone or its source differs from the verified version's. The tests of the tripwire itself feed it
a changed source, a changed signature, a removed definition and an unverified version. Also: the docs' table is
the register, and every registered library has an upper bound in pyproject.toml that every lock satisfies.
"""

from __future__ import annotations

import ast
import re
import shutil
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from asyncrl.core import patches
from asyncrl.core.patches import PATCHES, Patch

REPO = Path(__file__).resolve().parents[3]
BY_SYMBOL = {p.symbol: p for p in PATCHES}
PYDANTIC_CACHE = BY_SYMBOL["pydantic._internal._fields.takes_validated_data_argument"]


def trip(patch: Patch) -> None:
    """Fail (AssertionError) unless the installed library is a verified version with the verified source."""
    version = patches.installed_version(patch.dist)
    if version is None:
        pytest.skip(f"{patch.dist} is not installed")
    ranges = [spec for spec in patch.verified if SpecifierSet(spec).contains(version, prereleases=True)]
    assert ranges, (
        f"{patch.dist} {version} is outside the versions verified for {patch.symbol} ({list(patch.verified)}): "
        f"check the patch against it, then add its range and fingerprint (python -m asyncrl.core.patches)"
    )
    try:
        now = patches.fingerprint(patch)
    except LookupError as e:
        raise AssertionError(f"{patch.symbol}: the upstream code it depends on is gone: {e}") from e
    assert now == patch.verified[ranges[0]], (
        f"{patch.symbol}: {patch.dist} {version} changed {', '.join(patch.checks)} since it was verified "
        f"(fingerprint {now}, verified {patch.verified[ranges[0]]}): re-check {', '.join(patch.where)}"
    )


@pytest.mark.parametrize("patch", PATCHES, ids=[p.symbol for p in PATCHES])
def test_the_patched_code_is_as_verified(patch):
    trip(patch)


def test_every_entry_is_complete():
    for p in PATCHES:
        assert p.checks and p.where and p.why and p.remove_when and p.verified, p.symbol
        assert all(":" in c for c in p.checks), p.symbol
        assert all(re.fullmatch(r"[0-9a-f]{16}", f) for f in p.verified.values()), p.symbol
    assert len(BY_SYMBOL) == len(PATCHES)


# --- the tripwire fires ------------------------------------------------------------------------------------


@pytest.fixture
def upstream_copy(tmp_path, monkeypatch):
    """pydantic's `_internal/_fields.py` copied to tmp_path; the register reads the copy instead."""
    version = patches.installed_version("pydantic")
    if version is None:
        pytest.skip("pydantic is not installed")
    original = patches.module_file("pydantic", "pydantic._internal._fields")
    copy = tmp_path / "_fields.py"
    shutil.copy(original, copy)
    read = patches.module_file

    def module_file(dist: str, module: str) -> Path | None:
        return copy if module == "pydantic._internal._fields" else read(dist, module)

    monkeypatch.setattr(patches, "module_file", module_file)
    return copy


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


def test_the_tripwire_passes_an_unchanged_copy(upstream_copy):
    trip(PYDANTIC_CACHE)


def test_the_tripwire_fires_on_a_changed_body(upstream_copy):
    edit(upstream_copy, "return len(parameters) == 1", "return len(parameters) >= 1")
    with pytest.raises(AssertionError, match="changed pydantic._internal._fields:takes_validated_data_argument"):
        trip(PYDANTIC_CACHE)


def test_the_tripwire_fires_on_a_changed_signature(upstream_copy):
    edit(upstream_copy, "def takes_validated_data_argument(\n", "def takes_validated_data_argument(\n    *,\n")
    with pytest.raises(AssertionError, match="changed"):
        trip(PYDANTIC_CACHE)


def test_the_tripwire_fires_on_a_removed_definition(upstream_copy):
    edit(upstream_copy, "def takes_validated_data_argument(", "def takes_validated_data_argument_v2(")
    with pytest.raises(AssertionError, match="is gone: .*no definition of takes_validated_data_argument"):
        trip(PYDANTIC_CACHE)


def test_the_tripwire_fires_on_an_unverified_version(monkeypatch):
    monkeypatch.setattr(patches, "installed_version", lambda dist: "2.15.0")
    with pytest.raises(AssertionError, match="pydantic 2.15.0 is outside the versions verified"):
        trip(PYDANTIC_CACHE)


def test_a_builtin_symbol_is_checked_for_existence(monkeypatch):
    import atexit

    trip(BY_SYMBOL["atexit._run_exitfuncs"])
    monkeypatch.delattr(atexit, "_run_exitfuncs")
    with pytest.raises(AssertionError, match="is gone"):
        trip(BY_SYMBOL["atexit._run_exitfuncs"])


# --- the register's other copies: the docs, pyproject's bounds, the locks ----------------------------------


def test_the_docs_table_is_the_register():
    doc = (REPO / "docs" / "development.md").read_text()
    assert patches.DOC_SECTION in doc
    assert patches.doc_table() in doc, "regenerate the table: asyncrl.core.patches.doc_table()"


def declared() -> dict[str, list[Requirement]]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    lines = [*project["dependencies"], *(d for extra in project["optional-dependencies"].values() for d in extra)]
    found: dict[str, list[Requirement]] = {}
    for line in lines:
        req = Requirement(line)
        found.setdefault(req.name, []).append(req)
    return found


def locked() -> dict[str, set[str]]:
    pins: dict[str, set[str]] = {}
    for lock in (REPO / "requirements").glob("*.lock"):
        for name, version in re.findall(r"^([A-Za-z0-9_.-]+)==([^\s;]+)", lock.read_text(), re.M):
            pins.setdefault(name.lower(), set()).add(version)
    return pins


@pytest.mark.parametrize("dist", sorted({p.dist for p in PATCHES} - {patches.PYTHON}))
def test_every_patched_library_is_bounded_and_the_locks_agree(dist):
    """An upper bound in pyproject.toml on each registered library (its next minor or major beyond the versions
    verified), which every lock's pin of it satisfies."""
    names = patches.DIST_NAMES.get(dist, (dist,))
    reqs = [r for name in names for r in declared().get(name, [])]
    assert any(s.operator in ("<", "<=") for r in reqs for s in r.specifier), f"{dist}: no upper bound"
    for name in names:
        for version in locked().get(name, ()):
            for req in (r for r in reqs if r.name == name):
                assert req.specifier.contains(version, prereleases=True), f"{name}=={version} (a lock) vs {req}"


def test_the_verified_versions_are_within_the_bounds():
    for p in (p for p in PATCHES if p.dist != patches.PYTHON):
        reqs = [r for name in patches.DIST_NAMES.get(p.dist, (p.dist,)) for r in declared().get(name, [])]
        for spec in p.verified:
            for pin in re.findall(r"[<>=~]=?\s*([0-9][^,]*)", spec):
                assert all(r.specifier.contains(Version(pin)) for r in reqs), f"{p.symbol}: {pin} vs {reqs}"


@pytest.mark.parametrize("patch", patches.PATCHES, ids=lambda p: p.symbol)
def test_each_place_of_ours_exists(patch):
    """Each `where` names a module under src/asyncrl and a name it defines at top level (read, not imported:
    some need vLLM): a module moved or a function renamed fails here until the register follows."""
    for where in patch.where:
        module, _, name = where.partition(":")
        path = REPO / "src" / "asyncrl" / module.replace(".", "/")
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        assert path.is_file(), f"{patch.symbol}: no module asyncrl.{module} ({where})"
        tree = ast.parse(path.read_text())
        top = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
        top |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
        assert name.split(".")[0] in top, f"{patch.symbol}: asyncrl.{module} defines no {name.split('.')[0]}"
