"""Fixtures of the trainer's unit tests."""

import pytest
import torch


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir):
    """The tiny test model in float32, eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
