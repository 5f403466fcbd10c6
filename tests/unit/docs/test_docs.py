"""README.md is a short front door and docs/*.md hold the rest: sizes, the set-up block, and every relative link."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]

LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")


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
