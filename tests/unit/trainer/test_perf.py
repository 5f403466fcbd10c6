"""FLOP accounting and MFU arithmetic."""

import pytest
import torch
from transformers import Qwen3Config

from asyncrl.trainer.perf import FlopModel, mfu, peak_flops


def test_row_flops_counts_each_packed_sample_separately():
    fm = FlopModel(matmul_params=1000, layers=2, heads=4, head_dim=8)
    # per sample: 6*N*s + 12*L*H*d*s^2
    expected = sum(6 * 1000 * s + 12 * 2 * 4 * 8 * s * s for s in (3, 5))
    assert fm.row_flops(torch.tensor([3, 5])) == expected
    assert fm.row_flops(torch.tensor([8])) > expected  # one long sample attends over more


def test_from_hf_config_uses_head_dim():
    cfg = Qwen3Config(hidden_size=64, num_attention_heads=4, head_dim=32, num_hidden_layers=3)
    fm = FlopModel.from_hf_config(cfg, 123)
    assert (fm.layers, fm.heads, fm.head_dim, fm.matmul_params) == (3, 4, 32, 123)


def test_mfu():
    assert mfu(989e12 * 0.5, 1.0, 989e12, 1) == pytest.approx(50.0)
    assert mfu(989e12, 1.0, 989e12, 2) == pytest.approx(50.0)
    assert mfu(1.0, 1.0, None, 1) is None
    assert peak_flops(torch.device("cpu")) is None


def test_throughput_summary_skips_the_warmup_step():
    from asyncrl.trainer.perf import throughput_summary

    history = [{"tokens": 10, "step_time_s": 100.0, "mfu": None, "peak_mem_gib": 9.0}] + [
        {"tokens": 1000, "step_time_s": 0.5, "mfu": m, "peak_mem_gib": 1.5} for m in (10.0, 20.0)
    ]
    text = throughput_summary(history)
    assert "tokens/s 2,000 | MFU 15.00% | step 0.500s" in text and "steps timed 2" in text
    assert "n/a" in throughput_summary([dict(h, mfu=None) for h in history])
