"""Per-token statistics straight from the last hidden states: the lm_head runs chunk by chunk, so no
[tokens, vocab] logits tensor exists for the whole micro-batch, in forward or in backward.

For every token t of a micro-batch the losses need, from the distribution that predicts it (the logits row
at t-1, or at parents[t] on shared-prefix rows; scaled by the token's temperature): logπ(token), the entropy,
and with forward-KL targets w (weights over the teacher's top-k tokens x_k) the cross-entropy -Σ_k w_k·logπ(x_k)
and KL(q‖π) over those tokens, q = w / Σw. `stats` is the four as a [rows, length, 4] tensor (`LOGPROB`,
`ENTROPY`, `TEACHER_CE`, `TEACHER_KL`); positions that predict nothing (a row's first, parent -1) get 0.

`HeadStatsFn` computes them `chunk_rows(vocab)` positions at a time and keeps only the hidden rows it read;
its backward recomputes each chunk's logits and gives the gradients of the hidden rows, lm_head weight and
bias. The largest transient is a few [chunk, vocab] float32 blocks (`CHUNK_BYTES` each). Same values and
gradients as autograd through full logits (`trainer.loss.token_logprobs` and friends), to float rounding.

`head_stats(model, request)` puts this in the model's own forward: within it, `model(...).logits` is the stats
tensor. The lm_head's forward is swapped for the chunked one on the instance, so it still runs inside the
root module's forward, where FSDP2 has gathered its weight (tied to the embedding or not). Models that change
logits after the lm_head (soft-capping, a logit scale) or whose head is not a linear layer are served from
full logits instead (`supported`): the same statistics, computed by the same function over the logits rows.
Invariants: a request is consumed by exactly one lm_head call; outside the context the model is unchanged.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from loguru import logger
from torch import nn

LOGPROB, ENTROPY, TEACHER_CE, TEACHER_KL = range(4)
CHUNK_BYTES = 256 * 2**20  # one [chunk, vocab] float32 block
MAX_CHUNK_ROWS = 8192


@dataclass
class HeadRequest:
    """What the statistics are of: per token (shape [rows, length]) its id, temperature and (optionally) the
    row-local index of the position whose logits predict it; forward-KL targets [rows, length, K]."""

    input_ids: torch.Tensor
    temperatures: torch.Tensor
    parents: torch.Tensor | None = None
    teacher_ids: torch.Tensor | None = None
    teacher_targets: torch.Tensor | None = None
    chunk: int | None = None  # positions per chunk (None: `chunk_rows`)
    fused: bool = True  # False: from the model's full logits (`fused_lm_head_chunk_size = "disabled"`)
    consumed: bool = False

    def sources(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(flat index of the hidden row predicting each token, whether it has one), both [rows * length]."""
        rows, length = self.input_ids.shape
        device = self.input_ids.device
        if self.parents is None:
            local = torch.arange(-1, length - 1, device=device).expand(rows, length)
        else:
            local = self.parents
        valid = (local >= 0).flatten()
        start = torch.arange(0, rows * length, length, device=device)[:, None]
        return (local.clamp(min=0) + start).flatten(), valid


def head_setting(value: int | str | None) -> dict:
    """`HeadRequest` fields for a `model.fused_lm_head_chunk_size` setting."""
    return {"chunk": value if isinstance(value, int) else None, "fused": value != "disabled"}


def chunk_rows(vocab: int, chunk: int | None = None) -> int:
    """Positions per chunk: `chunk`, or one [chunk, vocab] float32 block within `CHUNK_BYTES`."""
    return chunk or max(1, min(MAX_CHUNK_ROWS, CHUNK_BYTES // (4 * vocab)))


def supported(model: nn.Module) -> bool:
    """The model's logits are its lm_head's output unchanged, and that head is a linear layer."""
    config = getattr(model, "config", None)
    changes_logits = any(getattr(config, a, None) is not None for a in ("final_logit_softcapping", "logit_scale"))
    return type(model.get_output_embeddings()) is nn.Linear and not changes_logits


def model_stats(model: nn.Module, request: HeadRequest, **model_kwargs) -> torch.Tensor:
    """`request`'s [rows, length, 4] statistics of `model(**model_kwargs)`: through the chunked head where
    `supported`, else from the model's full logits."""
    if not request.fused or not supported(model):
        if request.fused:
            _say_full_logits(type(model).__name__)
        return stats_from_rows(model(**model_kwargs).logits, request)
    with head_stats(model, request):
        return model(**model_kwargs).logits


@functools.cache
def _say_full_logits(name: str) -> None:
    logger.info(f"{name}: logits are not its lm_head's output as is; token statistics come from full logits")


@contextlib.contextmanager
def head_stats(model: nn.Module, request: HeadRequest) -> Iterator[None]:
    """Within: `model(...).logits` is `request`'s [rows, length, 4] statistics (module docstring)."""
    head = model.get_output_embeddings()
    head.forward = functools.partial(_chunked_forward, head, request)
    try:
        yield
    finally:
        del head.forward
    if not request.consumed:
        raise RuntimeError(f"{type(model).__name__} computed its logits without calling its lm_head")


def _chunked_forward(head: nn.Linear, request: HeadRequest, hidden: torch.Tensor) -> torch.Tensor:
    if request.consumed:
        raise RuntimeError("the lm_head ran twice in one head_stats request")
    request.consumed = True
    return stats_from_rows(hidden, request, head.weight, head.bias)


def stats_from_rows(
    hidden: torch.Tensor, request: HeadRequest, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """[rows, length, 4] statistics of `request` from `hidden` [rows, length, H] through the head (`weight`,
    `bias`), or from logits [rows, length, V] when `weight` is None."""
    index, valid = request.sources()
    picked = hidden.flatten(0, 1).index_select(0, index)
    teacher = (None, None)
    if request.teacher_ids is not None:
        teacher = (request.teacher_ids.flatten(0, 1), request.teacher_targets.flatten(0, 1).float())
    temps = request.temperatures.flatten().float()
    ids = request.input_ids.flatten()
    out = HeadStatsFn.apply(picked, weight, bias, temps, ids, valid, *teacher, request.chunk)
    # stacked from views, so the result is no view: FSDP2 hooks the root module's output for backward
    return torch.stack([o.view(request.input_ids.shape) for o in out], dim=-1)


def _scaled_logprobs(h: torch.Tensor, weight, bias, temps: torch.Tensor) -> torch.Tensor:
    """log_softmax of one chunk's temperature-scaled logits, float32 [chunk, V]."""
    logits = h if weight is None else nn.functional.linear(h, weight, bias)
    scaled = logits.to(torch.float32, copy=weight is None)  # a copy of the rows it was given, never them
    return torch.log_softmax(scaled.div_(temps[:, None]), dim=-1)


class HeadStatsFn(torch.autograd.Function):
    """(hidden rows [N, H], weight, bias, temps, ids, valid, teacher ids [N, K], targets [N, K], chunk) ->
    logπ, entropy, teacher CE, teacher KL, each [N]; KL carries no gradient."""

    @staticmethod
    def forward(ctx, h, weight, bias, temps, ids, valid, t_ids, t_w, chunk):
        ctx.save_for_backward(h, weight, bias, temps, ids, valid, t_ids, t_w)
        n = h.shape[0]
        out = [torch.zeros(n, dtype=torch.float32, device=h.device) for _ in range(4)]
        ctx.step = step = chunk_rows(h.shape[-1] if weight is None else weight.shape[0], chunk)
        for a in range(0, n, step):
            b = min(a + step, n)
            logp = _scaled_logprobs(h[a:b], weight, bias, temps[a:b])
            out[LOGPROB][a:b] = logp.gather(-1, ids[a:b, None]).squeeze(-1)
            out[ENTROPY][a:b] = -(logp.exp() * logp).sum(-1)
            if t_ids is not None:
                w = t_w[a:b]
                picked = logp.gather(-1, t_ids[a:b])
                out[TEACHER_CE][a:b] = -(w * picked).sum(-1)
                q = w / w.sum(-1, keepdim=True).clamp(min=1e-30)
                out[TEACHER_KL][a:b] = torch.where(q > 0, q * (q.clamp(min=1e-30).log() - picked), 0.0).sum(-1)
        out = [torch.where(valid, o, 0.0) for o in out]
        ctx.mark_non_differentiable(out[TEACHER_KL])
        return tuple(out)

    @staticmethod
    def backward(ctx, g_lp, g_ent, g_ce, _g_kl):
        h, weight, bias, temps, ids, valid, t_ids, t_w = ctx.saved_tensors
        grads = tuple(torch.where(valid, g, 0.0) for g in (g_lp, g_ent, g_ce))
        grad_h = torch.empty_like(h)
        grad_w = None if weight is None else torch.zeros(weight.shape, dtype=torch.float32, device=h.device)
        grad_b = None if bias is None else torch.zeros(bias.shape, dtype=torch.float32, device=h.device)
        step = ctx.step
        for a in range(0, h.shape[0], step):
            b = min(a + step, h.shape[0])
            logp = _scaled_logprobs(h[a:b], weight, bias, temps[a:b])
            teacher = None if t_ids is None else (t_ids[a:b], t_w[a:b])
            g = _logit_grad(logp, ids[a:b], teacher, *(x[a:b, None] for x in grads))
            g = g.div_(temps[a:b, None]).to(h.dtype)  # through the temperature scaling and the float32 cast
            if weight is None:
                grad_h[a:b] = g
                continue
            grad_h[a:b] = g @ weight
            grad_w += (g.t() @ h[a:b]).float()
            if grad_b is not None:
                grad_b += g.float().sum(0)
        return grad_h, _like(grad_w, weight), _like(grad_b, bias), None, None, None, None, None, None


def _logit_grad(logp, ids, teacher, g_lp, g_ent, g_ce) -> torch.Tensor:
    """d(Σ g·stat)/d(scaled logits) of one chunk from its log-probabilities [chunk, V] (overwritten; at most one
    more such block alive): logπ(y) gives onehot(y) - p, the entropy H gives -p·(logp + H), the teacher CE
    gives Σw·p - Σ_k w_k·onehot(x_k)."""
    p = logp.exp()
    entropy = -(p * logp).sum(-1, keepdim=True)
    coef = logp.add_(entropy).mul_(-g_ent).sub_(g_lp)  # in logp's own block: it is not read again
    if teacher is not None:
        coef.add_(g_ce * teacher[1].sum(-1, keepdim=True))
    grad = p.mul_(coef)
    grad.scatter_add_(-1, ids[:, None], g_lp)
    if teacher is not None:
        grad.scatter_add_(-1, teacher[0], -g_ce * teacher[1])
    return grad


def _like(grad: torch.Tensor | None, param: torch.Tensor | None) -> torch.Tensor | None:
    return None if grad is None else grad.to(param.dtype)
