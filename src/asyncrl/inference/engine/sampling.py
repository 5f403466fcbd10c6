"""Batched on-device sampling with per-row temperature / top-k / top-p / min-p / seed.

The logprob returned for a sampled token is its log-probability under the exact distribution it was
drawn from: log_softmax of (logits / T) after the row's filters. With no filters that is exactly
log_softmax(logits / T), which is what the trainer recomputes, so importance ratios are exact.
Greedy rows (T == 0) take the argmax and report log_softmax(logits). A request's logit_bias is added
to the logits first (OpenAI semantics), so it is part of the distribution too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncrl.inference.api.backend import SamplingParams


@dataclass
class SampleOutput:
    tokens: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]] | None  # per row, only for rows that asked (else [])


class RowSampler:
    """Per-sequence sampling state: its params, its generator (if seeded)."""

    def __init__(self, params: SamplingParams, seed: int | None, device: torch.device):
        self.params = params
        self.generator: torch.Generator | None = None
        if seed is not None:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(seed)


def _filter_rows(scaled: torch.Tensor, rows: list[RowSampler]) -> torch.Tensor:
    """Apply min-p, top-k and top-p (in that order) to the scaled logits of `rows` (all filtered)."""
    device = scaled.device
    vocab = scaled.shape[-1]
    min_p = torch.tensor([r.params.min_p for r in rows], device=device, dtype=scaled.dtype)
    if bool((min_p > 0).any()):
        probs = scaled.softmax(-1)
        threshold = probs.max(-1, keepdim=True).values * min_p[:, None]
        scaled = scaled.masked_fill(probs < threshold, float("-inf"))
    top_k = torch.tensor([r.params.top_k if 0 < r.params.top_k < vocab else vocab for r in rows], device=device)
    top_p = torch.tensor([r.params.top_p for r in rows], device=device, dtype=scaled.dtype)
    if bool((top_k < vocab).any()) or bool((top_p < 1).any()):
        sorted_logits, order = scaled.sort(-1, descending=True)
        ranks = torch.arange(vocab, device=device)[None, :]
        remove = ranks >= top_k[:, None]
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass strictly before it already reaches top_p (the first always stays)
        before = probs.cumsum(-1) - probs
        remove = remove | (before >= top_p[:, None])
        remove[:, 0] = False
        scaled = scaled.scatter(-1, order, sorted_logits.masked_fill(remove, float("-inf")))
    return scaled


def _log_exponential_noise(logprobs: torch.Tensor, rows: list[RowSampler]) -> torch.Tensor:
    """log E per element, E ~ Exp(1): argmax(logp - log E) draws from p (exponential race). Unseeded rows
    take E = -log U from one uniform draw (a fifth of `exponential_`'s cost on CPU); seeded rows draw
    from their own generator with `exponential_`, so a seed gives the same tokens as before."""
    noise = torch.rand_like(logprobs).log_().neg_()
    for i, r in enumerate(rows):
        if r.generator is not None:
            noise[i] = torch.empty(logprobs.shape[1], device=logprobs.device).exponential_(generator=r.generator)
    return noise.log_()


def sample(logits: torch.Tensor, rows: list[RowSampler], banned: list[list[int]] | None = None) -> SampleOutput:
    """Sample one token per row of `logits` [B, V]; `banned[r]` token ids are excluded (min_tokens)."""
    logits = logits.float()
    device = logits.device
    if any(r.params.logit_bias for r in rows):
        logits = logits.clone()  # never write into the caller's tensor
    for i, r in enumerate(rows):
        if r.params.logit_bias:
            ids = torch.tensor(list(r.params.logit_bias), device=device)
            logits[i, ids] += torch.tensor(list(r.params.logit_bias.values()), device=device)
    temps = torch.tensor([r.params.temperature for r in rows], device=device)
    greedy = temps == 0
    scaled = logits / torch.where(greedy, torch.ones_like(temps), temps)[:, None]
    if banned is not None:
        for i, ids in enumerate(banned):
            if ids:
                scaled[i, ids] = float("-inf")
    filt = [i for i, r in enumerate(rows) if r.params.filtered and not r.params.greedy]
    if filt:
        idx = torch.tensor(filt, device=device)
        scaled[idx] = _filter_rows(scaled[idx], [rows[i] for i in filt])
    logprobs = scaled.log_softmax(-1)

    race = logprobs - _log_exponential_noise(logprobs, rows)
    race = torch.where(greedy[:, None], logprobs, race)
    tokens = race.argmax(-1)
    chosen = logprobs.gather(-1, tokens[:, None])[:, 0]

    top = None
    wants = [r.params.logprobs or 0 for r in rows]
    k = max(wants)
    if k > 0:
        vals, ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
        vals, ids = vals.tolist(), ids.tolist()
        top = [list(zip(ids[i][: wants[i]], vals[i][: wants[i]])) for i in range(len(rows))]
    return SampleOutput(tokens=tokens.tolist(), logprobs=chosen.tolist(), top=top)
