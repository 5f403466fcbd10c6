"""The config layer's notes on stderr: one line per key, once per process (an older spelling, an ignored option).

It imports nothing of asyncrl, so the config models (`base.py`) and the loader can both use it without a cycle.
"""

from __future__ import annotations

import sys

_noted: set[str] = set()  # notes already printed in this process


def note_older_spelling(old: str, new: str) -> None:
    """One stderr line, once per process, saying an accepted spelling is the older one."""
    note_once(old, f"note: {old} is the older spelling of {new}")


def note_once(key: str, line: str) -> None:
    if key not in _noted:
        _noted.add(key)
        print(line, file=sys.stderr)
