"""Refuse staged files over a size limit (pre-commit hook): a repo holds source, not binaries or build outputs."""

import subprocess
import sys
from pathlib import Path

LIMIT_KB = 500


def main() -> int:
    staged = subprocess.run(
        ["git", "diff", "--cached", "--name-only", "--diff-filter=AM"], capture_output=True, text=True, check=True
    ).stdout.split()
    big = [f for f in staged if Path(f).is_file() and Path(f).stat().st_size > LIMIT_KB * 1024]
    for f in big:
        print(f"{f}: {Path(f).stat().st_size // 1024} KB > {LIMIT_KB} KB; do not commit binaries or build outputs")
    return 1 if big else 0


if __name__ == "__main__":
    sys.exit(main())
