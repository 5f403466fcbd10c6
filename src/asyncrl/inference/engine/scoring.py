"""Prompt logprobs (vLLM's `prompt_logprobs`) from the logits of a prefill forward.

Invariants: the scores are of the raw model, whatever the request samples with (no temperature, bias or
filters: vLLM's prompt scores skip its sampling processors too), computed as log_softmax in float32; a
token's rank counts the vocabulary entries scoring at least as high, itself included (vLLM's count).
"""

from __future__ import annotations

import torch

from asyncrl.inference.api.backend import PromptLogprobs

SCORE_LOGITS_BYTES = 512 * 2**20  # float32 logits one scoring forward may hold; bounds its tokens


def score_token_cap(vocab_size: int, max_prefill_tokens: int) -> int:
    """Prompt tokens one scoring forward takes: its whole logits must fit SCORE_LOGITS_BYTES."""
    return max(1, min(max_prefill_tokens, SCORE_LOGITS_BYTES // (4 * vocab_size)))


def score(logits: torch.Tensor, targets: list[int], k: int) -> PromptLogprobs:
    """Scores of `targets` [T] under `logits` [T, V] (row t predicts targets[t]), plus the top k when k > 0."""
    if not targets:
        return PromptLogprobs([], [], [] if k > 0 else None)
    logprobs = logits.float().log_softmax(-1)
    ids = torch.tensor(targets, device=logprobs.device)[:, None]
    chosen = logprobs.gather(-1, ids)
    ranks = (logprobs >= chosen).sum(-1)
    top = None
    if k > 0:
        vals, top_ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
        top = [list(zip(i, v)) for i, v in zip(top_ids.tolist(), vals.tolist())]
    return PromptLogprobs(chosen[:, 0].tolist(), ranks.tolist(), top)
