"""Policy-gradient losses over the loss-mask tokens of one packed micro-batch, and logprobs from logits.

Every loss gets `LossInputs` (per-token tensors of one packed row) and returns `LossOutput`: the loss
SUMMED over loss-mask tokens plus metrics that are also token sums. The trainer divides both by the
number of loss-mask tokens of the whole step (all micro-batches, all ranks), so the gradient is the
per-token mean over the step and does not depend on how samples were packed or split across ranks.

Ratios are r = exp(logπ - logμ) with μ the sampler's logprob carried in the batch. Built-ins:

- `aipo` (default): token IS weight r, detached, times A·logπ; tokens with r outside
  [token_mask_low, token_mask_high] are dropped.
- `grpo`: PPO-clip, -min(r·A, clip(r, 1-clip_low, 1+clip_high)·A), gradient through r.
- `gspo`: the same clip on the sequence ratio s = exp(mean over the sample's tokens of logπ - logμ),
  per token as sg(s)·π/sg(π) (GSPO-token), so each token's gradient is s·A·∇logπ.
- `cispo`: clipped IS weight, detached: -sg(clip(r, 1-clip_low, 1+clip_high))·A·logπ.
- `custom`: `loss.custom = "module.path:function"`, same signature as the built-ins.

All built-ins drop whole samples whose geometric-mean ratio leaves [sequence_mask_low, sequence_mask_high].
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from asyncrl.config.trainer import LossConfig
from asyncrl.utils.errors import UserError


@dataclass
class LossInputs:
    logprobs: torch.Tensor  # (T,) float32, current policy, carries the gradient
    inference_logprobs: torch.Tensor  # (T,) float32, sampler's logprobs μ
    advantages: torch.Tensor  # (T,) float32
    loss_mask: torch.Tensor  # (T,) bool
    sample_ids: torch.Tensor  # (T,) int64 in [0, num_samples): which packed sample a token belongs to
    num_samples: int


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar: sum over loss-mask tokens
    metrics: dict[str, torch.Tensor]  # scalars: sums over loss-mask tokens (reported as per-token means)


LossFn = Callable[[LossInputs, LossConfig], LossOutput]


def token_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, temperatures: torch.Tensor, parents: torch.Tensor | None = None
) -> torch.Tensor:
    """logπ(token_t | prefix) for every position of a packed row, from logits / the token's temperature.

    logits: (T, V) for one row, or (rows, T, V) with ids and temperatures (rows, T). Without `parents`
    token t is scored by the logits at t-1 and position 0 gets 0 (it is never a loss token, since every
    sample starts with prompt). With `parents` (shape of ids; row-local indices, see `transport.prefix`)
    token t is scored by the logits at parents[t], and tokens with parent -1 get 0. Computed as
    gather - logsumexp so autograd keeps one (T, V) copy.
    """
    if parents is not None:
        return _parent_logprobs(logits, input_ids, temperatures, parents)
    scaled = logits[..., :-1, :].float() / temperatures[..., 1:, None].float()
    picked = scaled.gather(-1, input_ids[..., 1:, None]).squeeze(-1)
    lp = picked - torch.logsumexp(scaled, dim=-1)
    return torch.cat([lp.new_zeros(*lp.shape[:-1], 1), lp], dim=-1)


def _parent_rows(logits: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """(N, V) float32: the logits row of every token's parent (row 0 of its row where it has none)."""
    length = logits.shape[-2]
    row_start = torch.arange(0, parents.numel(), length, device=parents.device).view(*parents.shape[:-1], 1)
    index = (parents.clamp(min=0) + row_start).flatten()
    # index_select makes the one (N, V) copy; the scaling happens in place on it (or on its float32 cast)
    return logits.flatten(0, -2).index_select(0, index).float()


def _parent_logprobs(logits, input_ids, temperatures, parents) -> torch.Tensor:
    scaled = _parent_rows(logits, parents).div_(temperatures.flatten()[:, None].float())
    picked = scaled.gather(-1, input_ids.flatten()[:, None]).squeeze(-1)
    lp = picked - torch.logsumexp(scaled, dim=-1)
    return torch.where(parents.flatten() >= 0, lp, 0.0).view(parents.shape)


@torch.no_grad()
def token_entropy(
    logits: torch.Tensor, temperatures: torch.Tensor, chunk: int = 1024, parents: torch.Tensor | None = None
) -> torch.Tensor:
    """Entropy of the (temperature-scaled) distribution that predicts each token of one row: the one at
    t-1 (position 0 gets 0), or with `parents` the one at parents[t] (parent -1 gets 0)."""
    if parents is not None:
        return _parent_entropy(logits, temperatures, chunk, parents)
    out = [logits.new_zeros(1, dtype=torch.float32)]
    for start in range(0, logits.shape[0] - 1, chunk):
        end = min(start + chunk, logits.shape[0] - 1)
        logp = torch.log_softmax(logits[start:end].float() / temperatures[start + 1 : end + 1, None].float(), -1)
        out.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(out)


def _parent_entropy(logits, temperatures, chunk, parents) -> torch.Tensor:
    out = []
    for start in range(0, logits.shape[0], chunk):
        p = parents[start : start + chunk]
        logp = torch.log_softmax(_parent_rows(logits, p).div_(temperatures[start : start + chunk, None].float()), -1)
        out.append(torch.where(p >= 0, -(logp.exp() * logp).sum(-1), 0.0))
    return torch.cat(out) if out else logits.new_zeros(0, dtype=torch.float32)


def _per_sample_mean(values: torch.Tensor, mask: torch.Tensor, sample_ids: torch.Tensor, n: int) -> torch.Tensor:
    """Mean of `values` over each sample's loss-mask tokens (0 for samples without any)."""
    m = mask.to(values.dtype)
    sums = torch.zeros(n, dtype=values.dtype, device=values.device).index_add(0, sample_ids, values * m)
    counts = torch.zeros(n, dtype=values.dtype, device=values.device).index_add(0, sample_ids, m)
    return sums / counts.clamp(min=1)


def _sequence_mask(x: LossInputs, cfg: LossConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token flags: the token's sample has geometric-mean ratio below / above the sequence bounds."""
    log_ratio = (x.logprobs.detach() - x.inference_logprobs) * x.loss_mask
    geo = _per_sample_mean(log_ratio, x.loss_mask, x.sample_ids, x.num_samples).exp()[x.sample_ids]
    return x.loss_mask & (geo < cfg.sequence_mask_low), x.loss_mask & (geo > cfg.sequence_mask_high)


def _count(flags: torch.Tensor) -> torch.Tensor:
    return flags.sum().float()


def aipo_loss(x: LossInputs, cfg: LossConfig) -> LossOutput:
    ratio = torch.exp(x.logprobs.detach() - x.inference_logprobs)
    tok_low = x.loss_mask & (ratio < cfg.token_mask_low)
    tok_high = x.loss_mask & (ratio > cfg.token_mask_high)
    seq_low, seq_high = _sequence_mask(x, cfg)
    keep = x.loss_mask & ~(tok_low | tok_high | seq_low | seq_high)
    # where(), not indexing: a huge ratio on a dropped token must not turn 0 * inf into a NaN gradient
    loss = -(torch.where(keep, ratio, 0.0) * x.advantages * x.logprobs).sum()
    metrics = {
        "masked_frac": _count(x.loss_mask & ~keep),
        "token_masked_low_frac": _count(tok_low),
        "token_masked_high_frac": _count(tok_high),
        "sequence_masked_low_frac": _count(seq_low),
        "sequence_masked_high_frac": _count(seq_high),
    }
    return LossOutput(loss, metrics)


def _kept_by_sequence(x: LossInputs, cfg: LossConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    seq_low, seq_high = _sequence_mask(x, cfg)
    keep = x.loss_mask & ~(seq_low | seq_high)
    metrics = {
        "masked_frac": _count(x.loss_mask & ~keep),
        "sequence_masked_low_frac": _count(seq_low),
        "sequence_masked_high_frac": _count(seq_high),
    }
    return keep, metrics


def _clipped_loss(log_ratio: torch.Tensor, keep: torch.Tensor, adv: torch.Tensor, cfg: LossConfig):
    """Σ_kept -min(r·A, clip(r, 1-clip_low, 1+clip_high)·A) and the count of tokens where the clip is active."""
    ratio = torch.exp(torch.where(keep, log_ratio, 0.0))  # dropped tokens: r = 1, no overflow
    clipped = torch.clamp(ratio, 1 - cfg.clip_low, 1 + cfg.clip_high)
    per_token = -torch.minimum(ratio * adv, clipped * adv)
    active = ((adv > 0) & (ratio > 1 + cfg.clip_high)) | ((adv < 0) & (ratio < 1 - cfg.clip_low))
    return torch.where(keep, per_token, 0.0).sum(), _count(keep & active.detach())


def grpo_loss(x: LossInputs, cfg: LossConfig) -> LossOutput:
    keep, metrics = _kept_by_sequence(x, cfg)
    loss, metrics["clipped_frac"] = _clipped_loss(x.logprobs - x.inference_logprobs, keep, x.advantages, cfg)
    return LossOutput(loss, metrics)


def gspo_loss(x: LossInputs, cfg: LossConfig) -> LossOutput:
    keep, metrics = _kept_by_sequence(x, cfg)
    log_ratio = torch.where(x.loss_mask, x.logprobs - x.inference_logprobs, 0.0)
    seq_log_ratio = _per_sample_mean(log_ratio, x.loss_mask, x.sample_ids, x.num_samples)[x.sample_ids]
    # value = log of the sequence ratio s; gradient = d logπ_t, so each token's gradient is s·A·∇logπ_t
    token_log_ratio = seq_log_ratio.detach() + x.logprobs - x.logprobs.detach()
    loss, metrics["clipped_frac"] = _clipped_loss(token_log_ratio, keep, x.advantages, cfg)
    return LossOutput(loss, metrics)


def cispo_loss(x: LossInputs, cfg: LossConfig) -> LossOutput:
    keep, metrics = _kept_by_sequence(x, cfg)
    ratio = torch.exp(torch.where(keep, x.logprobs.detach() - x.inference_logprobs, 0.0))
    weight = torch.clamp(ratio, 1 - cfg.clip_low, 1 + cfg.clip_high)
    loss = -(torch.where(keep, weight, 0.0) * x.advantages * x.logprobs).sum()
    metrics["clipped_frac"] = _count(keep & (weight != ratio))
    return LossOutput(loss, metrics)


BUILTIN: dict[str, LossFn] = {"aipo": aipo_loss, "grpo": grpo_loss, "gspo": gspo_loss, "cispo": cispo_loss}


def get_loss_fn(cfg: LossConfig) -> LossFn:
    if cfg.type != "custom":
        return BUILTIN[cfg.type]
    module_name, _, attr = (cfg.custom or "").partition(":")
    if not module_name or not attr:
        raise UserError(f"loss.custom = '{cfg.custom}' must look like 'module.path:function'")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise UserError(f"cannot import custom loss '{cfg.custom}': {e}") from e
    if not callable(fn):
        raise UserError(f"custom loss '{cfg.custom}' is not callable")
    return fn


@torch.no_grad()
def mismatch_kl_sum(x: LossInputs) -> torch.Tensor:
    """Σ over loss-mask tokens of r - log r - 1 (k3 estimator of KL(μ||π)); 0 when π == μ."""
    log_ratio = (x.logprobs.detach() - x.inference_logprobs)[x.loss_mask]
    return (torch.exp(log_ratio) - log_ratio - 1).sum()
