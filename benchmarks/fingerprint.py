"""What verifying a weight update costs: the fingerprints (transport/fingerprint.py) against the update itself.

Builds a random Qwen3 model of `--hidden`/`--layers` locally, publishes it as a bfloat16 weight dir, then
times, `--repeats` times each (median): the trainer fingerprinting what it publishes; the embedded engine's
update (read and check the dir, convert for the live float32 model and swap it in: `load_matching_weights`,
`staged`, `swap_in`);
and its fingerprints of what it then holds (`loaded_fingerprints`). Prints one table.

    .venv/bin/python benchmarks/fingerprint.py [--hidden 1024] [--layers 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from asyncrl.inference.engine.weight_loading import load_matching_weights, loaded_fingerprints, staged, swap_in
from asyncrl.transport import fingerprint
from asyncrl.utils.tiny_model import build_tiny_model


def median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        src = build_tiny_model(Path(tmp) / "model", hidden_size=args.hidden, num_layers=args.layers, num_heads=8)
        published = {k: v.to(torch.bfloat16) for k, v in load_file(src / "model.safetensors").items()}
        save_file(published, str(src / "model.safetensors"), metadata={"format": "pt"})
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
        size_mib = sum(t.numel() * t.element_size() for t in published.values()) / 2**20
        trainer_s = median_s(lambda: fingerprint.of_tensors(published), args.repeats)
        tensors = load_matching_weights(src, model)
        update_s = median_s(lambda: swap_in(model, staged(model, load_matching_weights(src, model))), args.repeats)
        server_s = median_s(lambda: loaded_fingerprints(model, tensors), args.repeats)
    print("| weights (bf16) | trainer: fingerprint | server: update | server: fingerprint | % of the update |")
    print("|---|---|---|---|---|")
    print(
        f"| {size_mib:.0f} MiB, {len(published)} tensors | {trainer_s * 1e3:.0f} ms | {update_s * 1e3:.0f} ms "
        f"| {server_s * 1e3:.0f} ms | {100 * server_s / update_s:.0f}% |"
    )


if __name__ == "__main__":
    main()
