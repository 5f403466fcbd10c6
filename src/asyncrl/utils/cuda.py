"""Whether CUDA is usable here, without importing torch where no GPU driver is present.

Importing torch costs ~1.5 s of CPU; the launcher and the config's engine choice only need a yes/no, and a
machine with no NVIDIA (or ROCm) device file has no CUDA whatever torch would say.
"""

from __future__ import annotations

from pathlib import Path


def gpu_driver_present() -> bool:
    """Whether an NVIDIA (or ROCm) driver exposes a device here: its device files exist."""
    dev = Path("/dev")
    return any(dev.glob("nvidia[0-9]*")) or (dev / "kfd").exists() or Path("/proc/driver/nvidia").exists()


def cuda_available() -> bool:
    """torch.cuda.is_available(), asked only where a GPU driver is present; a broken torch means no."""
    if not gpu_driver_present():
        return False
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - a broken torch just means "no CUDA" here
        return False
