"""The one exception type for user mistakes: entrypoints print it as a one-line error and exit 2."""


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
        "configs/debug/cpu/ (README: Seed configs)"
    )
