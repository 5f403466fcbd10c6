"""Build a tiny random-init Qwen3-architecture model and a byte-level ChatML tokenizer, offline.

No hub is reachable on CPU dev boxes and CI, so tests and CPU examples use these. The tokenizer maps
every byte to one token (ids 0-255) and adds the ChatML special tokens and Qwen's two tool-call delimiters,
so any text round-trips.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
# Qwen's tool-call delimiters: single (non-special) tokens, as in Qwen's own vocabulary, so a tool parser that
# looks for them by id (the `renderers` package's) finds them; they still decode to their text.
TOOL_TOKENS = ["<tool_call>", "</tool_call>"]

# ChatML with Qwen-style tool support. Unlike Qwen3's template it never rewrites earlier turns
# (no stripping of <think>), so every conversation prefix tokenizes to a prefix of the whole.
CHAT_TEMPLATE = (
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions. Function signatures are in <tools></tools>:\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\n"
    'To call a function, answer with <tool_call>{"name": ..., "arguments": {...}}</tool_call>.<|im_end|>\n'
    "{% elif messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' and loop.first %}"
    "{% elif message.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{% elif message.role == 'assistant' %}"
    "<|im_start|>assistant\n"
    "{% if message.reasoning_content %}<think>\n{{ message.reasoning_content }}\n</think>\n\n{% endif %}"
    "{% if message.content %}{{ message.content }}{% endif %}"
    "{% if message.tool_calls %}"
    "{% for call in message.tool_calls %}"
    "{% set fn = call.function if call.function is defined else call %}"
    '\n<tool_call>\n{"name": "{{ fn.name }}", "arguments": '
    "{% if fn.arguments is string %}{{ fn.arguments }}{% else %}{{ fn.arguments | tojson }}{% endif %}"
    "}\n</tool_call>"
    "{% endfor %}"
    "{% endif %}"
    "<|im_end|>\n"
    "{% else %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(out_dir: Path):
    """A byte-level fast tokenizer: token id == byte value, specials after 255."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_to_unicode = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins for bytes
    ordered = sorted(byte_to_unicode, key=lambda ch: _byte_of(ch))
    vocab = {ch: i for i, ch in enumerate(ordered)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        bos_token=None,
        unk_token=None,
        additional_special_tokens=["<|endoftext|>", "<|im_start|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 4096
    fast.save_pretrained(out_dir)
    return fast


def _byte_of(ch: str) -> int:
    # GPT-2's byte<->unicode map: printable latin-1 bytes map to themselves, the rest to 256+n.
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    code = ord(ch)
    if code in printable:
        return code
    rest = [b for b in range(256) if b not in printable]
    return rest[code - 256]


def build_tiny_model(
    out_dir: str | Path,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 4096,
    seed: int = 0,
    head_dim: int | None = None,
    vocab_size: int | None = None,
    experts: int = 0,
    experts_per_token: int = 2,
) -> Path:
    """Write a random-init Qwen3 causal LM + tokenizer to `out_dir` (HF format, safetensors); `vocab_size`
    above the byte tokenizer's gives a real model's embedding shape (the extra rows are never looked up).
    `experts` > 0: a Qwen3-MoE instead, every layer's MLP `experts` experts of `intermediate_size` (fused, as
    transformers holds them), `experts_per_token` routed per token."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

    if experts and not 1 <= experts_per_token <= experts:
        raise ValueError(f"experts_per_token ({experts_per_token}) must be between 1 and experts ({experts})")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out)
    tool_rows = len(TOOL_TOKENS)  # appended after the init below, so they leave every other weight as it was
    config = (Qwen3MoeConfig if experts else Qwen3Config)(
        **_moe_fields(experts, experts_per_token, intermediate_size or hidden_size),
        vocab_size=max(vocab_size or 0, len(tokenizer) - tool_rows),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or hidden_size * 3,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim or hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    if len(tokenizer) > config.vocab_size:
        _append_token_rows(model, len(tokenizer), seed)
    model.generation_config.eos_token_id = [config.eos_token_id, tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    spec = {"seed": seed, "hidden_size": hidden_size, "layers": num_layers}
    moe = {"experts": experts, "experts_per_token": experts_per_token} if experts else {}
    (out / "asyncrl_tiny.json").write_text(json.dumps(spec | moe))
    return out


def _moe_fields(experts: int, per_token: int, width: int) -> dict:
    """Qwen3-MoE's config fields for `experts` experts of MLP width `width` in every layer ({}: dense)."""
    if not experts:
        return {}
    return {"num_experts": experts, "num_experts_per_tok": per_token, "moe_intermediate_size": width,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True}  # fmt: skip


def _append_token_rows(model, vocab: int, seed: int) -> None:
    """Grow the (tied) embedding to `vocab` rows, the new ones from a generator of their own: the model's
    other weights stay exactly those of the same seed without them (the tests' warm-up depends on them)."""
    import torch

    old = model.get_input_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(seed + 1)
    rows = torch.randn(vocab - old, model.config.hidden_size, generator=gen) * model.config.initializer_range
    model.resize_token_embeddings(vocab, mean_resizing=False)
    with torch.no_grad():
        model.get_input_embeddings().weight[old:] = rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build a tiny random Qwen3 model + byte tokenizer (no download).")
    parser.add_argument("out_dir", help="directory to write the HF model into")
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--num-kv-heads", type=int, default=2)
    parser.add_argument("--intermediate-size", type=int, default=None, help="MLP width (default: 3 x hidden)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--experts", type=int, default=0, help="a mixture of experts: experts per layer (0: dense)")
    parser.add_argument("--experts-per-token", type=int, default=2, help="MoE: experts routed per token")
    args = parser.parse_args(argv)
    if args.experts < 0:
        parser.error(f"--experts ({args.experts}) must be 0 (a dense model) or more")
    if args.experts and not 1 <= args.experts_per_token <= args.experts:
        parser.error(f"--experts-per-token ({args.experts_per_token}) must be between 1 and --experts ({args.experts})")
    out = build_tiny_model(
        args.out_dir,
        args.hidden_size,
        args.num_layers,
        args.num_heads,
        args.num_kv_heads,
        args.intermediate_size,
        seed=args.seed,
        experts=args.experts,
        experts_per_token=args.experts_per_token,
    )
    size_mb = sum(p.stat().st_size for p in out.glob("*.safetensors")) / 1e6
    print(f"wrote tiny model to {out} ({size_mb:.1f} MB of weights)")


if __name__ == "__main__":
    main()
