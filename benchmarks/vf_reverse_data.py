"""Data for verifiers' own `reverse_text` v1 example (benchmarks/learning.py, task `vf-reverse`).

That environment (verifiers repository, environments/reverse_text, run unmodified) reads a Hugging Face
dataset named by its `dataset_name` arg, with a `prompt` column, and asks for the reversal inside
`<reversed_text>` tags under its own system prompt. Nothing is downloaded here: this writes a local
dataset (`DIR/dataset/{train,test}.jsonl`, random strings, `load_dataset(DIR/dataset, split=...)` reads
it) and SFT warm-up rows in that environment's exact format, from a third random stream.

    python benchmarks/vf_reverse_data.py --sft-out DIR/sft.jsonl --n 10000
"""

from __future__ import annotations

import argparse
import json
import random
import string
from pathlib import Path

SYSTEM = "Reverse the text character-by-character. Put your answer in <reversed_text> tags."  # the env's
SPLITS = {"train": 2000, "test": 200}
MIN_LEN, MAX_LEN = 3, 5  # short: the tiny model learns to reverse them inside the tags within its SFT warm-up


def strings(n: int, stream: str) -> list[str]:
    rng = random.Random(f"vf-reverse:{stream}")
    return ["".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(MIN_LEN, MAX_LEN))) for _ in range(n)]


def write(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sft-out", required=True, type=Path)
    ap.add_argument("--n", type=int, default=10000)
    args = ap.parse_args()
    for split, n in SPLITS.items():
        write(args.sft_out.parent / "dataset" / f"{split}.jsonl", [{"prompt": s} for s in strings(n, split)])
    sft = [
        {
            "prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": s}],
            "completion": [{"role": "assistant", "content": f"<reversed_text>{s[::-1]}</reversed_text>"}],
        }
        for s in strings(args.n, "sft")
    ]
    write(args.sft_out, sft)
    print(f"wrote {args.n} SFT rows and the dataset under {args.sft_out.parent}")


if __name__ == "__main__":
    main()
