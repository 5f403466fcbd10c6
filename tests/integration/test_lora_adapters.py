"""A LoRA run's adapters in PEFT format: `peft` and our inference engine load them on the base model and
get the logits of the trainer's own (merged) weights of the same step."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest
import torch

from asyncrl.transport.layout import RunLayout, is_stable
from tests import warm

sys.path.insert(0, str(Path(__file__).resolve().parent))  # server_proc, when run from another directory
from server_proc import BACKENDS  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def lora_run(tiny_model_dir, tmp_path_factory):
    """Two steps of the trainer on fake data, LoRA on the attention and MLP projections, a big learning rate
    (B starts at zero: a step must move it for the comparison to mean anything)."""
    from asyncrl.config.trainer import TrainerConfig
    from asyncrl.trainer.rl import train as train_in

    train = lambda cfg: train_in(cfg, RunLayout.for_config(cfg))  # noqa: E731  (as its entrypoint runs it)

    out = tmp_path_factory.mktemp("lora_run")
    lora = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}
    cfg = TrainerConfig.model_validate(
        {
            "model": {"name": str(tiny_model_dir), "lora": lora},
            "output_dir": str(out),
            "max_steps": 2,
            "optim": {"lr": 5e-2},
            "data": {"fake": {"batch_size": 4, "samples_per_row": 2, "seq_len": 32}},
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
    from asyncrl.transport import fingerprint  # beside the files, of their tensors: the adapter and the merged

    assert fingerprint.read(adapter) == fingerprint.of_tensors(tensors)
    merged = load_file(str(RunLayout(lora_run).weights_dir(2) / "model.safetensors"))
    assert fingerprint.read(RunLayout(lora_run).weights_dir(2)) == fingerprint.of_tensors(merged)


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


MISMATCH_TOL = {"embedded": 1e-6, "vllm": 1e-4}  # serving the base model instead: 0.02-0.03


@pytest.mark.parametrize("backend", BACKENDS)
def test_rl_serves_each_policy_as_the_runs_adapter(tmp_path_factory, tmp_path, backend):
    """`--orchestrator.lora-name`: every policy reaches the server through /load_lora_adapter (the base weights
    never change) and requests name the adapter. On-policy (async level 0), the trainer's logprobs of each batch
    equal the server's only if the server generated with exactly the trainer's adapter: mismatch KL ~ 0.
    (vLLM gets `--enable-lora --max-lora-rank 8` from rl.)"""
    import sys

    from asyncrl.utils.process import free_port
    from asyncrl.utils.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path_factory.mktemp("m"), hidden_size=128, num_layers=2, num_heads=4)  # vLLM: hd 32
    out = tmp_path / "run"
    args = ["--model.name", str(model), "--output-dir", str(out), "--max-steps", "5", "--seq-len", "96",
            "--inference.backend", backend,
            "--max-async-level", "0", "--inference.server.port", str(free_port()), "--orchestrator.batch-size", "16",
            "--orchestrator.rollouts-per-example", "4", "--orchestrator.sampling.max-tokens", "8",
            "--trainer.model.lora", "--trainer.model.lora.rank", "4", "--trainer.optim.lr", "5e-2",
            "--orchestrator.lora-name", "run-a"]  # fmt: skip
    done = warm.run([sys.executable, "-m", "asyncrl.entrypoints.rl", *args], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    layout = RunLayout(out)
    server_log = layout.log_file("inference").read_text() + layout.log_file("inference", ".stdout").read_text()
    if backend == "embedded":
        # policies 1..4 (step 0 uses the base model)
        assert layout.log_file("inference").read_text().count("loaded LoRA adapter 'run-a'") == 4
    else:
        assert "Loaded new LoRA adapter: name 'run-a'" in server_log
    assert "loaded weights from" not in server_log and "reloaded base weights" not in server_log
    rows = [json.loads(x) for x in RunLayout(out).metrics_file("trainer").read_text().splitlines()]
    assert max(r["mismatch_kl"] for r in rows) < MISMATCH_TOL[backend], [r["mismatch_kl"] for r in rows]
    assert max(abs(r["grad_norm"]) for r in rows) > 0


def test_rl_refuses_an_adapter_name_without_lora(tiny_model_dir, tmp_path):
    import sys

    args = ["--model.name", str(tiny_model_dir), "--output-dir", str(tmp_path), "--orchestrator.lora-name", "a"]
    done = warm.run([sys.executable, "-m", "asyncrl.entrypoints.rl", *args, "--dry-run"], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2 and "add --trainer.model.lora" in done.stderr and "Traceback" not in done.stderr
