"""A LoRA run's adapters in PEFT format: `peft` and our inference engine load them on the base model and
get the logits of the trainer's own (merged) weights of the same step."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from asyncrl.transport.layout import RunLayout, is_stable

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def lora_run(tiny_model_dir, tmp_path_factory):
    """Two steps of the trainer on fake data, LoRA on the attention and MLP projections, a big learning rate
    (B starts at zero: a step must move it for the comparison to mean anything)."""
    from asyncrl.config.trainer import TrainerConfig
    from asyncrl.trainer.rl import train

    out = tmp_path_factory.mktemp("lora_run")
    lora = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}
    cfg = TrainerConfig.model_validate(
        {
            "model": {"name": str(tiny_model_dir), "lora": lora},
            "output_dir": str(out),
            "max_steps": 2,
            "optim": {"lr": 5e-2},
            "data": {"fake": {"batch_size": 4, "micro_batch_size": 2, "seq_len": 32}},
        }
    )
    train(cfg)
    return out


IDS = torch.tensor([[5, 17, 42, 99, 7, 3, 120, 64]])


def logits_of(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits.float()


def test_the_exported_adapter_is_peft_format_and_moved(lora_run):
    adapter = RunLayout(lora_run).adapter_dir(2)
    assert is_stable(RunLayout(lora_run).weights_dir(2)) and adapter.parent == RunLayout(lora_run).weights_dir(2)
    assert (RunLayout(lora_run).broadcast_dir(2) / "adapter" / "adapter_model.safetensors").is_file()
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8.0)
    assert config["target_modules"] == ["down_proj", "q_proj", "v_proj"]
    from safetensors.torch import load_file

    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    assert all(k.startswith("base_model.model.model.layers.") for k in tensors)
    assert any(k.endswith("lora_B.weight") and t.abs().max() > 0 for k, t in tensors.items())  # it learned


def test_peft_loads_the_adapter_and_matches_the_merged_weights(lora_run, tiny_model_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    layout = RunLayout(lora_run)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    plain = logits_of(base)
    with_adapter = PeftModel.from_pretrained(base, str(layout.adapter_dir(2))).eval()
    merged = AutoModelForCausalLM.from_pretrained(layout.weights_dir(2), dtype=torch.float32).eval()
    ours = logits_of(merged)
    assert (ours - plain).abs().max() > 1e-3  # the adapter changes the model
    assert torch.allclose(logits_of(with_adapter), ours, atol=1e-4), (logits_of(with_adapter) - ours).abs().max()


def test_the_embedded_engine_serves_the_adapter_by_name(lora_run, tiny_model_dir):
    """Greedy tokens and logprobs with the adapter chosen by name = those of the merged weights."""
    from transformers import AutoModelForCausalLM

    from asyncrl.config.inference import InferenceConfig
    from asyncrl.inference.api.backend import SamplingParams
    from asyncrl.inference.engine import EmbeddedEngine

    engine = EmbeddedEngine(InferenceConfig(model={"name": str(tiny_model_dir)}, num_threads=torch.get_num_threads()))
    prompt = IDS[0].tolist()

    async def generate():  # one event loop: the engine's scheduler lives in it
        await engine.start()
        await engine.load_lora_adapter("run-a", str(RunLayout(lora_run).adapter_dir(2)))
        ids, lps = [], []
        async for d in engine.generate(prompt, SamplingParams(max_tokens=6, temperature=0), lora_name="run-a"):
            ids += d.token_ids
            lps += d.logprobs
        await engine.shutdown()
        return ids, lps

    ids, lps = asyncio.run(generate())
    merged = AutoModelForCausalLM.from_pretrained(RunLayout(lora_run).weights_dir(2), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = merged(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]
    assert ids == logits.argmax(-1).tolist()
    ref = logits.log_softmax(-1).gather(1, torch.tensor(ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(lps), ref, atol=1e-4)
