"""The one exception type for user mistakes: entrypoints print it as a one-line error and exit 2.

A full disk is treated the same way (`disk_full`): the user frees space and resumes; a traceback from
deep inside torch or safetensors would not tell them that.
"""

import errno


class UserError(Exception):
    """A mistake the user can fix (bad config, missing file, ...). The message says what and how."""


def model_hint(name: str) -> str:
    """How to fix a model that would not load: a hub id needs the hub (or the local HF cache)."""
    from pathlib import Path

    if name.startswith(("/", ".", "~")) or Path(name).expanduser().exists():
        return "check --model.name"
    return (
        f"'{name}' is a Hugging Face hub id: it needs network access to huggingface.co (or a copy in the local "
        "HF cache; gated models: huggingface-cli login). Without a GPU or hub access run the CPU twins in "
        "configs/debug/cpu/ (docs/configuration.md: PRIME-RL configs)"
    )


FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_FULL_WORDS = ("No space left on device", "Disk quota exceeded", "file write failed")  # torch/safetensors say


def disk_full(error: BaseException) -> str | None:
    """One line for an error a full disk caused (looked for along its causes), else None."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in FULL:
            where = f" writing {seen.filename}" if seen.filename else ""
            return f"the disk is full ({seen.strerror}){where}: {FULL_HINT}"
        if any(word in str(seen) for word in _FULL_WORDS):
            return f"the disk is full ({type(seen).__name__}: {str(seen).strip().splitlines()[-1][:200]}): {FULL_HINT}"
        seen = seen.__cause__ or seen.__context__
    return None


LOW_SPACE_BYTES = 16 * 2**20  # less free than this where a write failed: the disk is to blame


def raise_if_full(where, error: BaseException) -> None:
    """A write under `where` failed with `error`: if that disk is (nearly) full, raise ENOSPC naming `where`
    (torch and safetensors report a full disk as e.g. "iostream error", which says nothing)."""
    import os
    import shutil
    from pathlib import Path

    if isinstance(error, OSError) and error.errno in FULL:
        return
    existing = next(p for p in (Path(where), *Path(where).parents) if p.exists())
    if disk_full(error) is not None or shutil.disk_usage(existing).free < LOW_SPACE_BYTES:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(where)) from error


FULL_HINT = "free space (or move --output-dir), then resume with --ckpt.resume-step -1; complete checkpoints are intact"
