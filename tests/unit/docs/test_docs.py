"""README.md is a short front door and docs/*.md hold the rest: sizes, the set-up block, every relative link, and
no dates or commit hashes outside docs/benchmarks.md (latest figures) and docs/log.md (dated history); the code map
(docs/architecture.md) names only paths that exist."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
DATED = {"benchmarks.md", "log.md"}  # the only pages that may carry dates and commit hashes
GUIDES = [p for p in PAGES if p.name not in DATED or p.parent != ROOT / "docs"]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
PACKAGE = ROOT / "src" / "asyncrl"

LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")

# 7-40 hex characters with at least one digit and one letter, not inside a path, word or version string
COMMIT_HASH = re.compile(r"(?<![\w./+-])(?=[0-9a-fA-F]*[a-fA-F])(?=[0-9a-fA-F]*[0-9])[0-9a-fA-F]{7,40}(?![\w/+-])")
_MONTH = (
    r"(?:January|February|March|April|May|June|July|August|September|October|November|December"
    r"|Jan|Feb|Mar|Apr|Jun|Jul|Aug|Sept|Sep|Oct|Nov|Dec)\.?"
)
DATE = re.compile(
    r"\b(?:(?:19|20)\d\d-(?:0[1-9]|1[0-2])(?:-\d\d)?\b"  # 2026-11-27, 2026-11
    rf"|{_MONTH}\s+\d{{1,2}}(?:st|nd|rd|th)?\b"  # Nov 27, November 27th
    rf"|\d{{1,2}}(?:st|nd|rd|th)?\s+{_MONTH}(?![a-z])"  # 27 Nov, 27 November
    r"|\d{1,2}/\d{1,2}/(?:19|20)\d\d\b)"  # 11/27/2026
)


def dated(text: str) -> list[str]:
    """Each date or commit hash in `text`, as `line N: match: the line`."""
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        for m in [*DATE.finditer(line), *COMMIT_HASH.finditer(line)]:
            found.append(f"line {n}: {m.group(0)!r}: {line.strip()[:100]}")
    return found


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks (a `# comment` in a bash block is not a heading)."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return out


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped except '-' and '_', spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())  # a link in a heading anchors on its text
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in prose_lines(path.read_text()):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        a = anchor(m.group(1))
        n = seen.get(a, 0)
        seen[a] = n + 1
        out.add(a if n == 0 else f"{a}-{n}")  # GitHub numbers repeated headings: x, x-1, x-2
    return out


def relative_links(path: Path) -> list[str]:
    links = []
    for line in prose_lines(path.read_text()):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
                continue
            links.append(target)
    return links


def test_readme_is_a_front_door():
    n = len(README.read_text().splitlines())
    assert n <= 250, f"README.md has {n} lines (at most 250): move the detail into a page under docs/"


def test_readme_setup_block_has_the_two_commands():
    text = README.read_text()
    m = re.search(r"^## Set up and run.*?$\n+```bash\n(.*?)^```", text, re.M | re.S)
    assert m, "README.md needs a '## Set up and run' section that opens with a ```bash block"
    block = m.group(1)
    assert "./scripts/demo.sh" in block
    assert "./scripts/test.sh" in block  # CI runs the README's test command


def test_docs_pages_exist():
    names = {p.name for p in DOCS}
    for name in [
        "configuration.md",
        "rl.md",
        "learning.md",
        "inference.md",
        "workflow.md",
        "deployment.md",
        "reliability.md",
        "benchmarks.md",
        "development.md",
        "architecture.md",
    ]:
        assert name in names, f"docs/{name} is missing"
        assert f"docs/{name}" in README.read_text(), f"README.md does not link docs/{name}"


def test_anchor_rules():
    assert anchor("Multi-run LoRA (`[[runs]]`): several runs") == "multi-run-lora-runs-several-runs"
    assert anchor("`rl --bench` against TRL") == "rl---bench-against-trl"
    assert anchor("Status and report (`asyncrl status`, `asyncrl report`)") == (
        "status-and-report-asyncrl-status-asyncrl-report"
    )
    assert anchor("use_snake_case") == "use_snake_case"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path):
    broken = []
    for target in relative_links(page):
        file_part, _, frag = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
            continue
        if frag and dest.suffix == ".md" and frag not in anchors(dest):
            broken.append(f"{target}: no heading with anchor #{frag} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: broken links:\n" + "\n".join(broken)


def test_guides_are_found():
    """The date check below runs on real pages: the README and every guide, but never the two dated pages."""
    names = {p.name for p in GUIDES}
    assert README in GUIDES
    assert {"rl.md", "development.md", "learning.md", "inference.md", "workflow.md", "reliability.md"} <= names
    assert not names & DATED, names & DATED
    assert all((ROOT / "docs" / name).is_file() for name in DATED)
    assert all(p.read_text().strip() for p in GUIDES)


@pytest.mark.parametrize("page", GUIDES, ids=lambda p: str(p.relative_to(ROOT)))
def test_guides_hold_no_dates_or_commit_hashes(page: Path):
    found = dated(page.read_text())
    assert not found, (
        f"{page.relative_to(ROOT)} says what holds now: a dated figure goes to docs/benchmarks.md (the latest "
        "of each), dated history to docs/log.md, and the page links there. Found:\n" + "\n".join(found)
    )


@pytest.mark.parametrize(
    "text",
    [
        "measured on 2026-11-27",
        "the log of 2026-11",
        "on Nov 27 the engine",
        "since November 3rd",
        "on 27 Nov the run",
        "(27 November, 2 cores)",
        "11/27/2026",
        "the code of d777a83",
        "commit a310c92e5f0b1c2d3e4f5a6b7c8d9e0f1a2b3c4d",
        "`git show 1D8783B`",
    ],
)
def test_date_check_catches(text: str):
    assert dated(f"A guide line.\n{text}\n"), text


@pytest.mark.parametrize(
    "text",
    [
        "0.626 with it, 0.632 without",
        "weights/step_200 and rollouts/step_1",
        "torch 2.11.0+cu130, cuDNN 91900, 1,272 requests",
        "lr 1e-3, 9.5e-07, 16,384 tokens",
        "a facade, deadbeef, decade, 1234567",
        "Use 2 runs; in March or May it may; Decode 4 tokens; Marker 3; Octet 8",
        "sha256:" + "0123456789abcdef" * 4,
        "https://example.org/blob/d777a83/x.py and src/asyncrl/d777a83.py",
        "the #1f77b4 line; Qwen3-0.6B; x86_64; e4m3",
    ],
)
def test_date_check_leaves_alone(text: str):
    assert not dated(text), dated(text)


def test_date_check_fails_on_an_injected_date(tmp_path: Path):
    """A copy of a real guide passes, and the same copy with one dated line does not."""
    page = ROOT / "docs" / "rl.md"
    assert not dated(page.read_text())
    injected = page.read_text().replace("\n\n", "\n\nMeasured on 2026-11-27 (2 cores).\n\n", 1)
    found = dated(injected)
    assert len(found) == 1 and "'2026-11-27'" in found[0], found


# ------------------------------------------------------------------ the code map (docs/architecture.md)

# A path the page names: from the repository root when it starts with src/, tests/ or docs/ (a file or a dir);
# any other `a/b.py` is under src/asyncrl/ (the page's stated convention). Run-dir paths (rollouts/step_N) and
# bare file names are neither, and are not checked.
ROOTED_PATH = re.compile(r"(?<![\w./-])(?:src|tests|docs)/[\w./-]*")
PACKAGE_PATH = re.compile(r"(?<![\w./-])(?:[\w-]+/)+[\w-]+\.py\b")


def named_paths(text: str) -> list[tuple[str, Path]]:
    """Each (path as written, where it resolves) that `text` names, in order."""
    found = []
    for m in ROOTED_PATH.finditer(text):
        found.append((m.group(0).rstrip("."), ROOT / m.group(0).rstrip(".")))
    for m in PACKAGE_PATH.finditer(text):
        path = m.group(0)
        if path.startswith(("src/", "tests/", "docs/")):
            continue  # rooted: above
        base = ROOT / "src" if path.startswith("asyncrl/") else PACKAGE
        found.append((path, base / path))
    return found


def missing_paths(text: str) -> list[str]:
    return [f"{written} (no {dest.relative_to(ROOT)})" for written, dest in named_paths(text) if not dest.exists()]


def test_architecture_page_is_short():
    assert ARCHITECTURE.is_file(), "docs/architecture.md (the code map) is missing"
    n = len(ARCHITECTURE.read_text().splitlines())
    assert n <= 150, f"docs/architecture.md has {n} lines (at most 150): it is a map, the detail is in the code"


def test_architecture_paths_exist():
    text = ARCHITECTURE.read_text()
    assert len(named_paths(text)) >= 30, "the code map names its files as paths (see its convention)"
    missing = missing_paths(text)
    assert not missing, "docs/architecture.md names paths that do not exist:\n" + "\n".join(missing)


@pytest.mark.parametrize(
    "text, bad",
    [
        ("read `orchestrator/loops.py` first", "orchestrator/loops.py"),
        ("see `src/asyncrl/transport/rows.py`", "src/asyncrl/transport/rows.py"),
        ("guarded by `tests/unit/transport/test_rows.py`.", "tests/unit/transport/test_rows.py"),
        ("the pages in docs/nothing.md", "docs/nothing.md"),
        ("`asyncrl/trainer/sesion.py`", "asyncrl/trainer/sesion.py"),
    ],
)
def test_path_check_catches_a_misspelled_path(text: str, bad: str):
    assert [w for w, _ in named_paths(text)] == [bad]
    assert missing_paths(text) == [f"{bad} (no {named_paths(text)[0][1].relative_to(ROOT)})"]


def test_path_check_leaves_alone_what_is_no_source_path():
    text = (
        "`orchestrator/loop.py`, src/asyncrl/transport/, `tests/unit/docs/test_docs.py`, docs/rl.md. "
        "rollouts/step_N/rank_R.pt, broadcast/step_{n+1}/, `meta.json`, loop.py, https://example.org/a/b.html"
    )
    assert [w for w, _ in named_paths(text)] == [
        "src/asyncrl/transport/",
        "tests/unit/docs/test_docs.py",
        "docs/rl.md",
        "orchestrator/loop.py",
    ]
    assert not missing_paths(text)


def test_each_process_builds_its_run_layout_once():
    """The README says each process builds its RunLayout once from its config and passes it down: the entrypoints'
    `entry`, the launcher's per-run layouts and the multi-run trainer's; a fourth call is a layout built twice."""
    calls = {
        str(p.relative_to(ROOT)): p.read_text().count("RunLayout.for_config")
        for p in sorted(PACKAGE.rglob("*.py"))
        if "RunLayout.for_config" in p.read_text()
    }
    assert sum(calls.values()) <= 3, f"RunLayout.for_config is called {sum(calls.values())} times: {calls}"
