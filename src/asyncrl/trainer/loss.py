"""Policy-gradient losses over the loss-mask tokens of one packed micro-batch, and logprobs from logits.

Every loss gets `LossInputs` (per-token tensors of one packed row) and returns `LossOutput`: the loss
SUMMED over loss-mask tokens plus metrics that are also token sums. The trainer divides both by the
number of loss-mask tokens of the whole step (all micro-batches, all ranks), so the gradient is the
per-token mean over the step and does not depend on how samples were packed or split across ranks.

Ratios are r = exp(logπ - logμ) with μ the sampler's logprob carried in the batch (with
max_async_level = k, μ may be up to k policies old). Objectives (`loss.type`):

- `aipo`: token IS weight r, detached, times A·logπ; tokens with r outside
  [token_mask_low, token_mask_high] are dropped (token-level MIS). PRIME-RL's default.
- `dppo`: a trust region on the probability change since the sampler: tokens whose probability rose more
  than dppo_mask_high (A > 0) or fell more than dppo_mask_low (A <= 0) are dropped, the rest give -A·r with
  the gradient through r (PRIME-RL's current objective).
- `grpo` (the default, chosen by benchmarks/learning.py: docs/learning.md): PPO-clip,
  -min(r·A, clip(r, 1-clip_low, 1+clip_high)·A), gradient through r; a trust region around the sampler.
- `gspo`: the same clip on the sequence ratio s = exp(mean over the sample's tokens of logπ - logμ),
  per token as sg(s)·π/sg(π) (GSPO-token), so each token's gradient is s·A·∇logπ.
- `cispo`: clipped IS weight, detached: -sg(clip(r, 1-clip_low, 1+clip_high))·A·logπ.
- `m2po`: a trust region on the second moment of the log ratio (M2PO, Zheng et al. 2025): the fewest tokens
  with the largest (log r)² are dropped so that the mean (log r)² of each sample's kept loss tokens is at
  most `m2_max` (per sample, not per batch as in the paper, so packing cannot change it); the rest give
  -A·r with the gradient through r, unclipped. Its region adapts to the drift the data actually carries,
  so it needs no knowledge of how stale each sample is.
- `custom`: `loss.custom = "module.path:function"`, same signature as the built-ins.

All built-ins drop whole samples whose geometric-mean ratio leaves [sequence_mask_low, sequence_mask_high]
(sequence-level MIS) and, when `token_is_cap` / `sequence_is_cap` are set, scale each token's term by
min(1, cap/r) / min(1, cap/s) (token / sequence TIS: the importance weight is truncated at the cap).
Every loss, custom included, then gets `kl_tau`·(logπ - logμ)² (a pull toward the sampler) and, with
reference logprobs, `ref_kl`·k3(π‖π_ref) = ref_kl·(π_ref/π - log(π_ref/π) - 1) (a pull toward the start).

Forward-KL distillation adds, outside the objective, `teacher_cross_entropy`: at every position with teacher
targets w (the distillation weight times the teacher's top-k probabilities, renormalized), -Σ_k w_k·logπ(x_k),
the student's distribution there (temperature-scaled, like logπ) pulled toward the teacher's; its gradient is
that of weight·KL(teacher‖student) over the listed tokens.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from asyncrl.config.trainer import LossConfig
from asyncrl.core.errors import UserError


@dataclass
class LossInputs:
    logprobs: torch.Tensor  # (T,) float32, current policy, carries the gradient
    inference_logprobs: torch.Tensor  # (T,) float32, sampler's logprobs μ
    advantages: torch.Tensor  # (T,) float32
    loss_mask: torch.Tensor  # (T,) bool
    sample_ids: torch.Tensor  # (T,) int64 in [0, num_samples): which packed sample a token belongs to
    num_samples: int
    ref_logprobs: torch.Tensor | None = None  # (T,) float32, the start weights' logprobs (when ref_kl is on)


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar: sum over loss-mask tokens
    metrics: dict[str, torch.Tensor]  # scalars: sums over loss-mask tokens (reported as per-token means)


LossFn = Callable[[LossInputs, LossConfig], LossOutput]
MAX_LOG_RATIO = 80.0  # exp(80) ~ 5e34: finite in float32


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


def _parent_index(parents: torch.Tensor) -> torch.Tensor:
    """(N,): the flat index (over all rows' positions) of every token's parent (its row's 0 where it has none)."""
    length = parents.shape[-1]
    row_start = torch.arange(0, parents.numel(), length, device=parents.device).view(*parents.shape[:-1], 1)
    return (parents.clamp(min=0) + row_start).flatten()


def _parent_rows(logits: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """(N, V) float32: the logits row of every token's parent (row 0 of its row where it has none)."""
    # index_select makes the one (N, V) copy; the scaling happens in place on it (or on its float32 cast)
    return logits.flatten(0, -2).index_select(0, _parent_index(parents)).float()


def _parent_logprobs(logits, input_ids, temperatures, parents) -> torch.Tensor:
    scaled = _parent_rows(logits, parents).div_(temperatures.flatten()[:, None].float())
    picked = scaled.gather(-1, input_ids.flatten()[:, None]).squeeze(-1)
    lp = picked - torch.logsumexp(scaled, dim=-1)
    return torch.where(parents.flatten() >= 0, lp, 0.0).view(parents.shape)


def teacher_cross_entropy(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    teacher_ids: torch.Tensor,
    teacher_targets: torch.Tensor,
    parents: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ over positions of -Σ_k w_k·logπ(x_k), with the gradient; Σ over positions of KL(q‖π) over the listed
    tokens, q = w / Σw, no gradient), over the positions with any target mass. Shapes as `token_logprobs`, the
    teacher's (..., T, K); a token is predicted by the logits at t-1, or at parents[t]. Only those positions'
    logits rows are copied (one (n, V) float32 copy)."""
    targets = teacher_targets.flatten(0, -2).float()
    where = (targets.sum(-1) > 0).nonzero().squeeze(1)
    # position 0 of a row never has targets (every sample starts with prompt), so t-1 stays in its row
    source = where - 1 if parents is None else _parent_index(parents)[where]
    rows = logits.flatten(0, -2).index_select(0, source).float() / temperatures.flatten()[where, None].float()
    picked = torch.log_softmax(rows, dim=-1).gather(-1, teacher_ids.flatten(0, -2)[where])
    w = targets[where]
    ce = -(w * picked).sum()
    with torch.no_grad():
        q = w / w.sum(-1, keepdim=True)
        kl = torch.where(q > 0, q * (q.clamp(min=1e-30).log() - picked), 0.0).sum()
    return ce, kl


@torch.no_grad()
def token_entropy(
    logits: torch.Tensor, temperatures: torch.Tensor, chunk: int = 1024, parents: torch.Tensor | None = None
) -> torch.Tensor:
    """Entropy of the (temperature-scaled) distribution that predicts each token of one row: the one at
    t-1 (position 0 gets 0), or with `parents` the one at parents[t] (parent -1 gets 0). No gradient."""
    return entropy_with_grad(logits, temperatures, chunk, parents)


def entropy_with_grad(
    logits: torch.Tensor, temperatures: torch.Tensor, chunk: int = 1024, parents: torch.Tensor | None = None
) -> torch.Tensor:
    """`token_entropy` with the gradient kept (for an entropy bonus): autograd holds one (T, V) copy per chunk."""
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
        logp = torch.log_softmax(_parent_rows(logits, p) / temperatures[start : start + chunk, None].float(), -1)
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


def _ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    """exp of a log ratio, clamped so a token the sampler gave ~0 probability cannot overflow to inf."""
    return torch.exp(log_ratio.clamp(max=MAX_LOG_RATIO))


Objective = Callable[[LossInputs, LossConfig], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def aipo_objective(x: LossInputs, cfg: LossConfig):
    ratio = _ratio(x.logprobs.detach() - x.inference_logprobs)
    tok_low = x.loss_mask & (ratio < cfg.token_mask_low)
    tok_high = x.loss_mask & (ratio > cfg.token_mask_high)
    seq_low, seq_high = _sequence_mask(x, cfg)
    keep = x.loss_mask & ~(tok_low | tok_high | seq_low | seq_high)
    # where(), not indexing: a huge ratio on a dropped token must not turn 0 * inf into a NaN gradient
    per_token = -(torch.where(keep, ratio, 0.0) * x.advantages * x.logprobs)
    metrics = {
        "masked_frac": _count(x.loss_mask & ~keep),
        "token_masked_low_frac": _count(tok_low),
        "token_masked_high_frac": _count(tok_high),
        "sequence_masked_low_frac": _count(seq_low),
        "sequence_masked_high_frac": _count(seq_high),
    }
    return per_token, metrics


def _kept_by_sequence(x: LossInputs, cfg: LossConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    seq_low, seq_high = _sequence_mask(x, cfg)
    keep = x.loss_mask & ~(seq_low | seq_high)
    metrics = {
        "masked_frac": _count(x.loss_mask & ~keep),
        "sequence_masked_low_frac": _count(seq_low),
        "sequence_masked_high_frac": _count(seq_high),
    }
    return keep, metrics


def _clipped(log_ratio: torch.Tensor, keep: torch.Tensor, adv: torch.Tensor, cfg: LossConfig, metrics: dict):
    """Per token -min(r·A, clip(r, 1-clip_low, 1+clip_high)·A) on kept tokens; counts where each clip side is active."""
    ratio = torch.exp(torch.where(keep, log_ratio, 0.0))  # dropped tokens: r = 1, no overflow
    clipped = torch.clamp(ratio, 1 - cfg.clip_low, 1 + cfg.clip_high)
    per_token = -torch.minimum(ratio * adv, clipped * adv)
    high = keep & ((adv > 0) & (ratio > 1 + cfg.clip_high)).detach()
    low = keep & ((adv < 0) & (ratio < 1 - cfg.clip_low)).detach()
    metrics.update(clipped_frac=_count(high | low), clipped_high_frac=_count(high), clipped_low_frac=_count(low))
    return torch.where(keep, per_token, 0.0)


def grpo_objective(x: LossInputs, cfg: LossConfig):
    keep, metrics = _kept_by_sequence(x, cfg)
    return _clipped(x.logprobs - x.inference_logprobs, keep, x.advantages, cfg, metrics), metrics


def gspo_objective(x: LossInputs, cfg: LossConfig):
    keep, metrics = _kept_by_sequence(x, cfg)
    log_ratio = torch.where(x.loss_mask, x.logprobs - x.inference_logprobs, 0.0)
    seq_log_ratio = _per_sample_mean(log_ratio, x.loss_mask, x.sample_ids, x.num_samples)[x.sample_ids]
    # value = log of the sequence ratio s; gradient = d logπ_t, so each token's gradient is s·A·∇logπ_t
    token_log_ratio = seq_log_ratio.detach() + x.logprobs - x.logprobs.detach()
    return _clipped(token_log_ratio, keep, x.advantages, cfg, metrics), metrics


def cispo_objective(x: LossInputs, cfg: LossConfig):
    keep, metrics = _kept_by_sequence(x, cfg)
    ratio = torch.exp(torch.where(keep, x.logprobs.detach() - x.inference_logprobs, 0.0))
    weight = torch.clamp(ratio, 1 - cfg.clip_low, 1 + cfg.clip_high)
    per_token = -(torch.where(keep, weight, 0.0) * x.advantages * x.logprobs)
    metrics.update(
        clipped_frac=_count(keep & (weight != ratio)),
        clipped_high_frac=_count(keep & (ratio > 1 + cfg.clip_high)),
        clipped_low_frac=_count(keep & (ratio < 1 - cfg.clip_low)),
    )
    return per_token, metrics


def dppo_objective(x: LossInputs, cfg: LossConfig):
    """Trust region on the probability change since the sampler: a token whose probability already moved more
    than `dppo_mask_high` up (A > 0) or `dppo_mask_low` down (A <= 0) gets no gradient; the others -A·r."""
    keep, metrics = _kept_by_sequence(x, cfg)
    diff = x.logprobs.detach().exp() - x.inference_logprobs.exp()
    high = keep & (x.advantages > 0) & (diff > cfg.dppo_mask_high)
    low = keep & (x.advantages <= 0) & (diff < -cfg.dppo_mask_low)
    keep = keep & ~(high | low)
    ratio = _ratio(torch.where(keep, x.logprobs - x.inference_logprobs, 0.0))
    metrics["masked_frac"] = _count(x.loss_mask & ~keep)
    metrics.update(trust_masked_high_frac=_count(high), trust_masked_low_frac=_count(low))
    return -torch.where(keep, ratio * x.advantages, 0.0), metrics


def _second_moment_keep(x: LossInputs, log_ratio: torch.Tensor, keep: torch.Tensor, m2_max: float) -> torch.Tensor:
    """`keep` less, in each sample, the fewest tokens (largest (log r)² first) whose removal brings the
    sample's kept tokens' mean (log r)² to at most m2_max. Decided per sample, so packing cannot change it."""
    m2 = torch.where(keep, log_ratio.square(), 0.0)
    by_m2 = torch.argsort(torch.where(keep, m2, math.inf), stable=True)  # tokens not kept last
    order = by_m2[torch.argsort(x.sample_ids[by_m2], stable=True)]  # by sample, smallest (log r)² first
    sid, values = x.sample_ids[order], m2[order]
    counts = torch.bincount(sid, minlength=x.num_samples)
    starts = torch.cumsum(counts, 0) - counts
    sums = torch.cat([values.new_zeros(1), torch.cumsum(values, 0)])
    rank = torch.arange(len(order), device=order.device) - starts[sid]
    running = (sums[1:] - sums[starts[sid]]) / (rank + 1)  # never falls within a sample: the kept set is a prefix
    chosen = torch.zeros_like(keep)
    chosen[order] = keep[order] & (running <= m2_max)
    return chosen


def m2po_objective(x: LossInputs, cfg: LossConfig):
    """-A·r on the tokens `_second_moment_keep` leaves (the gradient through r), 0 on the dropped ones."""
    keep, metrics = _kept_by_sequence(x, cfg)
    log_ratio = torch.where(keep, x.logprobs - x.inference_logprobs, 0.0)
    region = _second_moment_keep(x, log_ratio.detach(), keep, cfg.m2_max)
    metrics["masked_frac"] = _count(x.loss_mask & ~region)
    metrics["second_moment_masked_frac"] = _count(keep & ~region)
    return -torch.where(region, _ratio(log_ratio) * x.advantages, 0.0), metrics


def _truncation(x: LossInputs, cfg: LossConfig) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """TIS: a detached per-token factor min(1, cap/r) (token) times min(1, cap/s) (sample's geometric-mean
    ratio s), so a token's importance weight never passes the caps. None when no cap is set."""
    if cfg.token_is_cap is None and cfg.sequence_is_cap is None:
        return None, {}
    log_ratio = torch.where(x.loss_mask, x.logprobs.detach() - x.inference_logprobs, 0.0)
    factor, metrics = torch.ones_like(log_ratio), {}
    if cfg.token_is_cap is not None:
        factor = factor * (math.log(cfg.token_is_cap) - log_ratio).clamp(max=0).exp()
        metrics["token_truncated_frac"] = _count(x.loss_mask & (log_ratio > math.log(cfg.token_is_cap)))
    if cfg.sequence_is_cap is not None:
        seq = _per_sample_mean(log_ratio, x.loss_mask, x.sample_ids, x.num_samples)[x.sample_ids]
        factor = factor * (math.log(cfg.sequence_is_cap) - seq).clamp(max=0).exp()
        metrics["sequence_truncated_frac"] = _count(x.loss_mask & (seq > math.log(cfg.sequence_is_cap)))
    return factor, metrics


def builtin_loss(objective: Objective) -> LossFn:
    """A built-in loss: the objective's per-token terms, importance-truncated when asked, summed."""

    def loss_fn(x: LossInputs, cfg: LossConfig) -> LossOutput:
        per_token, metrics = objective(x, cfg)
        factor, truncated = _truncation(x, cfg)
        if factor is not None:
            per_token = torch.where(x.loss_mask, per_token * factor, 0.0)
        return LossOutput(per_token.sum(), {**metrics, **truncated})

    loss_fn.__name__ = objective.__name__.replace("_objective", "_loss")
    return loss_fn


BUILTIN: dict[str, LossFn] = {
    "aipo": builtin_loss(aipo_objective),
    "grpo": builtin_loss(grpo_objective),
    "gspo": builtin_loss(gspo_objective),
    "cispo": builtin_loss(cispo_objective),
    "dppo": builtin_loss(dppo_objective),
    "m2po": builtin_loss(m2po_objective),
}


def with_penalties(fn: LossFn) -> LossFn:
    """`fn` plus the objective-independent terms: kl_tau·(logπ - logμ)² on every loss token (a pull back to the
    sampler) and ref_kl·k3(π‖π_ref) (a pull back to the start weights, when reference logprobs are given)."""

    def loss_fn(x: LossInputs, cfg: LossConfig) -> LossOutput:
        out = fn(x, cfg)
        if cfg.kl_tau > 0:
            log_ratio = torch.where(x.loss_mask, x.logprobs - x.inference_logprobs, 0.0)
            out.loss = out.loss + cfg.kl_tau * log_ratio.square().sum()
        if x.ref_logprobs is not None:
            delta = torch.where(x.loss_mask, x.ref_logprobs - x.logprobs, 0.0)
            k3 = torch.exp(delta) - delta - 1  # KL(π‖π_ref), k3 estimator; gradient pulls logπ toward π_ref
            out.metrics["ref_kl"] = k3.detach().sum()
            if cfg.ref_kl:
                out.loss = out.loss + cfg.ref_kl * k3.sum()
        return out

    return loss_fn


def get_loss_fn(cfg: LossConfig) -> LossFn:
    """The configured loss, with the kl_tau and ref_kl terms added."""
    return with_penalties(_objective_fn(cfg))


def _objective_fn(cfg: LossConfig) -> LossFn:
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
    """Σ over loss-mask tokens of r - log r - 1 (k3 estimator of KL(μ||π)); 0 when π == μ. In float64, as
    expm1(log r) - log r: in float32 a log ratio below ~1e-4 (fp32 numerics between sampler and trainer) gives 0."""
    log_ratio = (x.logprobs.detach() - x.inference_logprobs)[x.loss_mask].double()
    return (torch.expm1(log_ratio) - log_ratio).sum()
