"""utils.cuda: no GPU driver means no CUDA, answered without importing torch (the launcher's start stays light)."""

from __future__ import annotations

import subprocess
import sys

from asyncrl.utils import cuda


def test_no_driver_is_no_cuda_and_torch_stays_unimported():
    probe = (
        "import sys\n"
        "from asyncrl.utils import cuda\n"
        "cuda.gpu_driver_present = lambda: False\n"
        "assert cuda.cuda_available() is False\n"
        "from asyncrl.launcher.placement import Placement\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_with_a_driver_torch_decides(monkeypatch):
    import torch

    monkeypatch.setattr(cuda, "gpu_driver_present", lambda: True)
    for answer in (True, False):
        monkeypatch.setattr(torch.cuda, "is_available", lambda answer=answer: answer)
        assert cuda.cuda_available() is answer
