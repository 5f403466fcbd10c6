"""Throughput accounting: model FLOPs per packed row, MFU against the device's peak, peak memory.

FLOPs of one sample of length s (fwd + bwd, PaLM appendix B): 6·N·s + 12·L·H·d·s², with N the
matmul weights (all linear layers incl. lm_head), L layers, H attention heads, d head dim. MFU divides
achieved FLOP/s by the dense bf16 peak of the GPU; on CPU (or an unknown GPU) MFU is not reported.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass

import torch

# dense bf16 peak FLOP/s per device; the first matching substring of the device name wins
PEAK_FLOPS = [
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("H800", 989e12),
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("A10G", 70e12),
]


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in PEAK_FLOPS:
        if key in name:
            return flops
    return None


@dataclass
class FlopModel:
    matmul_params: int
    layers: int
    heads: int
    head_dim: int

    @classmethod
    def from_hf_config(cls, hf_config, matmul_params: int) -> FlopModel:
        heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        return cls(matmul_params, hf_config.num_hidden_layers, heads, head_dim)

    def row_flops(self, sample_lengths: torch.Tensor) -> float:
        """Training FLOPs of one packed row whose samples have these lengths."""
        s = sample_lengths.double()
        return float((6 * self.matmul_params * s + 12 * self.layers * self.heads * self.head_dim * s * s).sum())


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated GPU memory since the last reset, or the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def mfu(flops: float, seconds: float, peak: float | None, world_size: int) -> float | None:
    """Model FLOPs utilisation in percent (None when the peak is unknown)."""
    if peak is None or seconds <= 0:
        return None
    return 100.0 * flops / (seconds * peak * world_size)


def format_mfu(value: float | None) -> str:
    return f"{value:.1f}%" if value is not None else "n/a"


def throughput_summary(history: list[dict]) -> str:
    """The `--bench` result lines shared by both trainers: tokens/s, MFU, step time, peak memory."""
    timed = history[1:] or history  # the first step pays for warm-up
    seconds = sum(m["step_time_s"] for m in timed)
    mfus = [m["mfu"] for m in timed if m["mfu"] is not None]
    mfu_s = f"{sum(mfus) / len(mfus):.2f}%" if mfus else "n/a (CPU or unknown GPU)"
    return (
        f"bench | tokens/s {sum(m['tokens'] for m in timed) / seconds:,.0f} | MFU {mfu_s} | "
        f"step {seconds / len(timed):.3f}s\n"
        f"bench | peak memory {max(m['peak_mem_gib'] for m in timed):.2f} GiB | steps timed {len(timed)}"
    )
