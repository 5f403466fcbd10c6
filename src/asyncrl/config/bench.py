"""The bench job, `rl --bench`: the tiny-Qwen3 reverse-text GRPO run users compare with TRL's GRPOTrainer.

One job: say what the bench job runs, as constants and as `rl` config defaults (`apply_defaults`).
No torch and no environment imports here, so `rl`'s config resolution stays light. It lives on the config
floor because both `config.rl` (the defaults) and the `bench` package (the run, warm-up, scoring) read it.

Invariants:
- Every value a user gives (CLI, @ files, env vars) wins over these defaults; shared fields
  (`max_steps`, `max_async_level`, `seq_len`, `output_dir`, `model.name`) are filled at the top level
  only where no component sets them, so the launcher's contradiction check never fires on a default.
- The warmed model's directory is a function of the warm-up settings (`warm_key`): same settings,
  same directory, so a second run reuses it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

SYSTEM_PROMPT = "Reverse the text character by character."
USER_TEMPLATE = "{text}"  # the bare word
MIN_LEN, MAX_LEN = 5, 8
ENV_SEED = 0
TRAIN_EXAMPLES = 2000  # the RL prompts (the env's "train" stream)
SFT_EXAMPLES = 10000  # the warm-up data (the env's "sft" stream)
HELDOUT_WORDS = 128  # scored before and after RL (the env's "eval" stream minus any SFT/train word)
SAMPLES_PER_WORD = 4  # sampled (T=1) accuracy averages this many answers per word
MAX_NEW_TOKENS = 16
PROMPTS, ROLLOUTS = 16, 8
STEPS = 80
LR = 1e-4
ASYNC_LEVEL = 1
SEQ_LEN = 256
WARMUP_STEPS = 3  # steps left out of the medians (model load, first weight broadcast)
DEFAULT_OUTPUT_DIR = "outputs/bench"

MODEL = {"hidden_size": 128, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 512, "seed": 0}
# SFT warm-up: the first checkpoint (every `interval` steps) whose sampled (T=1) accuracy on the validation words
# reaches `target_accuracy`. Greedy accuracy is far higher by then (~0.9): T=1 samples a fat tail of bytes.
WARMUP = {
    "recipe": 1,  # bump when the procedure changes, so old caches are not reused
    "lr": 5e-4,  # 1e-3 and 2e-3 stall at loss ~2.5 for this model; 5e-4 breaks through near step 150
    "max_steps": 300,
    "interval": 10,
    "batch_size": 4,
    "seq_len": 512,
    "target_accuracy": 0.2,
    "sft_examples": SFT_EXAMPLES,
}

ENV_ARGS: dict[str, Any] = {
    "instructions": SYSTEM_PROMPT,
    "user_template": USER_TEMPLATE,
    "reward": "exact",
    "min_len": MIN_LEN,
    "max_len": MAX_LEN,
    "seed": ENV_SEED,
    "num_train_examples": TRAIN_EXAMPLES,
}


def warm_key() -> str:
    """Hash of everything that decides the warmed model."""
    spec = {"model": MODEL, "warmup": WARMUP, "env": ENV_ARGS}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:10]


def warm_dir(output_dir: str | Path) -> Path:
    """Where the warmed model of these settings is cached: `{output_dir}/warmup/{key}`."""
    return Path(output_dir) / "warmup" / warm_key()


def component_defaults() -> dict[str, Any]:
    """Trainer, orchestrator and inference settings of the job."""
    return {
        "trainer": {"optim": {"lr": LR, "weight_decay": 0.0, "max_norm": 1.0}},
        "orchestrator": {
            "batch_size": PROMPTS * ROLLOUTS,
            "rollouts_per_example": ROLLOUTS,
            "sampling": {"max_tokens": MAX_NEW_TOKENS, "temperature": 1.0},
            "env": [{"id": "reverse-text", "args": dict(ENV_ARGS)}],
        },
        "inference": {"max_batch_size": PROMPTS * ROLLOUTS, "server": {"host": "127.0.0.1"}},
    }


def _set_anywhere(raw: dict, top: tuple[str, ...], where: dict[str, tuple[str, ...] | None]) -> bool:
    from asyncrl.config.loader import get_path

    if get_path(raw, top) is not None:
        return True
    return any(
        path is not None and isinstance(raw.get(comp), dict) and get_path(raw[comp], path) is not None
        for comp, path in where.items()
    )


def apply_defaults(raw: dict, shared_at: dict[str, dict[str, tuple[str, ...] | None]]) -> dict:
    """`raw` (the user's `rl` config) over the job's defaults; the user's values win. `shared_at` is
    `config.rl.SHARED`: where each shared field may also be set per component."""
    from asyncrl.config.loader import deep_merge, get_path, set_path

    merged = deep_merge(component_defaults(), raw)  # --no-inference keeps None: the user's own server
    places = [("output_dir",)] + [(c, "output_dir") for c in ("trainer", "orchestrator", "inference")]
    output_dir = next((v for v in (get_path(merged, p) for p in places) if v), DEFAULT_OUTPUT_DIR)
    shared = {
        "model.name": str(warm_dir(output_dir) / "model"),
        "max_steps": STEPS,
        "max_async_level": ASYNC_LEVEL,
        "seq_len": SEQ_LEN,
        "output_dir": output_dir,
    }
    for name, value in shared.items():
        top = tuple(name.split("."))
        if not _set_anywhere(merged, top, shared_at[name]):
            set_path(merged, top, value)
    return merged
