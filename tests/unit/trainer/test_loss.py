"""Each loss against hand-computed values and gradients on a 2-sample packed row; logprob plumbing."""

import math

import pytest
import torch

from asyncrl.config.trainer import LossConfig
from asyncrl.core.errors import UserError
from asyncrl.trainer.loss import (
    BUILTIN,
    LossInputs,
    LossOutput,
    entropy_with_grad,
    get_loss_fn,
    mismatch_kl_sum,
    teacher_cross_entropy,
    token_entropy,
    token_logprobs,
)
from asyncrl.transport.prefix import segments

LN10, LN2 = math.log(10), math.log(2)


def make_inputs(logmu_token1: float = -1.0) -> LossInputs:
    """Two samples [p, c, c][p, c, c]: ratios r = [1, 10 | 0.5, 1], advantages +1 and -2."""
    positions = torch.tensor([0, 1, 2, 0, 1, 2])
    seg = segments(positions)
    sample_ids, n = seg.sample_ids, seg.num_samples
    logprobs = torch.tensor([0.0, -1.0, -2.0, 0.0, -0.5, -0.5], requires_grad=True)
    mu = torch.tensor([0.0, logmu_token1, -2.0 - LN10, 0.0, -0.5 + LN2, -0.5])
    adv = torch.tensor([0.0, 1.0, 1.0, 0.0, -2.0, -2.0])
    mask = torch.tensor([False, True, True, False, True, True])
    return LossInputs(logprobs, mu, adv, mask, sample_ids, n)


def run(name: str, x: LossInputs, **cfg) -> tuple[LossOutput, torch.Tensor]:
    out = BUILTIN[name](x, LossConfig(**cfg))
    out.loss.backward()
    return out, x.logprobs.grad


def test_sample_ids():
    s = segments(torch.tensor([0, 1, 2, 0, 0, 1]))
    assert s.num_samples == 3 and s.sample_ids.tolist() == [0, 0, 0, 1, 2, 2]


def test_aipo_hand_computed():
    out, grad = run("aipo", make_inputs())
    # token 2 (r = 10 > 8) is masked; kept: -(1*1*-1 + 0.5*-2*-0.5 + 1*-2*-0.5) = -0.5
    assert out.loss.item() == pytest.approx(-0.5)
    assert grad.tolist() == pytest.approx([0, -1.0, 0, 0, 1.0, 2.0])
    assert out.metrics["masked_frac"].item() == 1
    assert out.metrics["token_masked_high_frac"].item() == 1
    assert out.metrics["token_masked_low_frac"].item() == 0
    assert out.metrics["sequence_masked_high_frac"].item() == 0


def test_aipo_sequence_mask():
    # token 1 ratio 200: masked itself, and sample 0's geometric mean sqrt(2000) > 10 masks the whole sample
    out, grad = run("aipo", make_inputs(logmu_token1=-1.0 - math.log(200)))
    assert out.metrics["sequence_masked_high_frac"].item() == 2
    assert out.metrics["masked_frac"].item() == 2
    assert out.loss.item() == pytest.approx(-(0.5 * -2 * -0.5 + 1 * -2 * -0.5))
    assert grad[:3].tolist() == [0, 0, 0]


def test_grpo_hand_computed():
    out, grad = run("grpo", make_inputs())
    # -1 (r=1,A=1) - 1.28 (r=10 clipped) + 1.6 (r=0.5 clipped at 0.8, A=-2) + 2 (r=1, A=-2)
    assert out.loss.item() == pytest.approx(1.32)
    assert grad.tolist() == pytest.approx([0, -1.0, 0, 0, 0, 2.0])
    assert out.metrics["clipped_frac"].item() == 2


def test_gspo_hand_computed():
    s0, s1 = math.sqrt(10), 2**-0.5
    out, grad = run("gspo", make_inputs())  # clip 0.2 / 0.28: both sequences clipped
    assert out.loss.item() == pytest.approx(2 * -1.28 + 2 * 1.6)
    assert grad.abs().sum().item() == 0
    out, grad = run("gspo", make_inputs(), clip_low=0.5, clip_high=5.0)  # nothing clipped
    assert out.loss.item() == pytest.approx(-2 * s0 + 2 * 2 * s1)
    assert grad.tolist() == pytest.approx([0, -s0, -s0, 0, 2 * s1, 2 * s1])
    assert out.metrics["clipped_frac"].item() == 0


def test_cispo_hand_computed():
    out, grad = run("cispo", make_inputs())
    # weights clamp(r, 0.8, 1.28) = [1, 1.28, 0.8, 1], detached
    assert out.loss.item() == pytest.approx(1 + 2.56 - 0.8 - 1)
    assert grad.tolist() == pytest.approx([0, -1.0, -1.28, 0, 1.6, 2.0])
    assert out.metrics["clipped_frac"].item() == 2


def test_m2po_drops_the_largest_log_ratios_until_the_second_moment_fits():
    # (log r)² per sample: [0, ln²10 = 5.30 | ln²2 = 0.48, 0]; each sample's kept mean must be <= m2_max
    out, grad = run("m2po", make_inputs())  # 0.04: only the two r = 1 tokens fit (0.48 / 2 = 0.24 does not)
    assert out.loss.item() == pytest.approx(-1 + 2)
    assert grad.tolist() == pytest.approx([0, -1.0, 0, 0, 0, 2.0])
    assert out.metrics["second_moment_masked_frac"].item() == 2
    out, grad = run("m2po", make_inputs(), m2_max=0.3)  # the r = 0.5 token fits now: -A·r = +1, gradient -A·r
    assert out.loss.item() == pytest.approx(-1 + 1 + 2)
    assert grad.tolist() == pytest.approx([0, -1.0, 0, 0, 1.0, 2.0])
    out, grad = run("m2po", make_inputs(), m2_max=3.0)  # all fit (5.30 / 2 = 2.65): -A·r, r = 10 included
    assert out.loss.item() == pytest.approx(-1 - 10 + 1 + 2)
    assert grad.tolist() == pytest.approx([0, -1.0, -10.0, 0, 1.0, 2.0])
    assert out.metrics["masked_frac"].item() == 0


def test_m2po_at_ratio_one_is_the_policy_gradient():
    x = make_inputs()
    x.inference_logprobs = x.logprobs.detach().clone()
    out, grad = run("m2po", x)
    assert out.metrics["masked_frac"].item() == 0
    assert grad.tolist() == pytest.approx((-x.advantages * x.loss_mask).tolist())


def dppo_inputs(ref_logprobs: torch.Tensor | None = None) -> LossInputs:
    """Two samples [p, c, c][p, c, c] with real probabilities: A = +1 then -1.

    π / μ per completion token: 0.5/0.25 (rose 0.25), 0.3/0.2 (rose 0.1) | 0.1/0.4 (fell 0.3), 0.2/0.25 (fell 0.05).
    """
    seg = segments(torch.tensor([0, 1, 2, 0, 1, 2]))
    p = torch.tensor([1.0, 0.5, 0.3, 1.0, 0.1, 0.2])
    mu = torch.tensor([1.0, 0.25, 0.2, 1.0, 0.4, 0.25])
    adv = torch.tensor([0.0, 1.0, 1.0, 0.0, -1.0, -1.0])
    mask = torch.tensor([False, True, True, False, True, True])
    lp = p.log().requires_grad_(True)
    return LossInputs(lp, mu.log(), adv, mask, seg.sample_ids, seg.num_samples, ref_logprobs)


def test_dppo_hand_computed():
    out, grad = run("dppo", dppo_inputs())
    # token 1 (A > 0, rose 0.25 > 0.2) and token 4 (A < 0, fell 0.3 > 0.2) leave the trust region: dropped.
    # kept: -A·r = -1.5 (r = 1.5) and +0.8 (r = 0.8); d/dlogπ of -A·r is -A·r
    assert out.loss.item() == pytest.approx(-1.5 + 0.8)
    assert grad.tolist() == pytest.approx([0, 0, -1.5, 0, 0, 0.8])
    assert out.metrics["trust_masked_high_frac"].item() == 1
    assert out.metrics["trust_masked_low_frac"].item() == 1
    assert out.metrics["masked_frac"].item() == 2


def test_dppo_wider_region_keeps_everything():
    out, grad = run("dppo", dppo_inputs(), dppo_mask_low=0.5, dppo_mask_high=0.5)
    assert out.loss.item() == pytest.approx(-2 - 1.5 + 0.25 + 0.8)
    assert grad.tolist() == pytest.approx([0, -2, -1.5, 0, 0.25, 0.8])


def test_kl_tau_adds_squared_log_ratio_on_every_loss_token():
    x = dppo_inputs()
    out = get_loss_fn(LossConfig(type="dppo", kl_tau=0.1))(x, LossConfig(type="dppo", kl_tau=0.1))
    out.loss.backward()
    logr = [0, math.log(2), math.log(1.5), 0, math.log(0.25), math.log(0.8)]
    assert out.loss.item() == pytest.approx(-0.7 + 0.1 * sum(v * v for v in logr))
    # masked tokens too get the pull back: 0.2·log r
    expected = [0.2 * v + g for v, g in zip(logr, [0, 0, -1.5, 0, 0, 0.8])]
    assert x.logprobs.grad.tolist() == pytest.approx(expected)


def test_token_tis_truncates_the_weight():
    out, grad = run("aipo", make_inputs(), token_mask_high=100.0, token_is_cap=2.0)
    # weights min(r, 2) = [1, 2, 0.5, 1] (token 2's r = 10 truncated instead of masked)
    assert out.loss.item() == pytest.approx(-(1 * -1 + 2 * -2 + 0.5 * -2 * -0.5 + 1 * -2 * -0.5))
    assert grad.tolist() == pytest.approx([0, -1, -2, 0, 1, 2])
    assert out.metrics["token_truncated_frac"].item() == 1


def test_sequence_tis_scales_a_whole_sample():
    out, grad = run("aipo", make_inputs(), token_mask_high=100.0, sequence_is_cap=2.0)
    f = 2 / math.sqrt(10)  # sample 0's geometric-mean ratio sqrt(10) truncated at 2; sample 1's (0.71) untouched
    assert grad.tolist() == pytest.approx([0, -1 * f, -10 * f, 0, 1, 2])
    assert out.metrics["sequence_truncated_frac"].item() == 2


def test_tis_on_a_clipped_objective_scales_its_gradient():
    _, plain = run("grpo", make_inputs(logmu_token1=-1.0 - math.log(1.1)))
    _, capped = run("grpo", make_inputs(logmu_token1=-1.0 - math.log(1.1)), token_is_cap=1.05)
    # token 1: r = 1.1 inside the clip, gradient -A·r = -1.1; with the cap its weight is 1.05
    assert plain[1].item() == pytest.approx(-1.1) and capped[1].item() == pytest.approx(-1.05)


def test_ref_kl_pulls_toward_the_reference_and_is_logged():
    x0 = dppo_inputs()
    ref = x0.logprobs.detach().clone()
    ref[1] += math.log(2)  # the reference gives token 1 twice the policy's probability
    x = dppo_inputs(ref_logprobs=ref)
    cfg = LossConfig(type="dppo", ref_kl=0.5)
    out = get_loss_fn(cfg)(x, cfg)
    out.loss.backward()
    k3 = 2 - math.log(2) - 1  # e^δ - δ - 1 with δ = log 2
    assert out.metrics["ref_kl"].item() == pytest.approx(k3)
    assert out.loss.item() == pytest.approx(-0.7 + 0.5 * k3)
    # d k3 / d logπ = 1 - e^δ = -1: descent raises logπ toward the reference
    assert x.logprobs.grad.tolist() == pytest.approx([0, -0.5, -1.5, 0, 0, 0.8])
    off = get_loss_fn(LossConfig())(dppo_inputs(ref_logprobs=ref), LossConfig())
    assert off.metrics["ref_kl"].item() == pytest.approx(k3)  # logged without the penalty too


def test_entropy_with_grad_matches_and_raises_entropy():
    torch.manual_seed(0)
    logits = torch.randn(6, 5, requires_grad=True)
    temps = torch.ones(6)
    ent = entropy_with_grad(logits, temps, chunk=4)
    assert torch.allclose(ent, token_entropy(logits, temps, chunk=4))
    (-ent.sum()).backward()  # the bonus: minimise -entropy
    with torch.no_grad():
        after = token_entropy(logits - 0.5 * logits.grad, temps)
    assert after[1:].sum() > ent[1:].sum()


def test_mismatch_kl_hand_computed():
    x = make_inputs()
    expected = (10 - LN10 - 1) + (0.5 + LN2 - 1)
    assert mismatch_kl_sum(x).item() == pytest.approx(expected, rel=1e-6)


def test_no_nan_gradient_from_huge_masked_ratio():
    x = make_inputs(logmu_token1=-200.0)  # r = e^199 overflows float32
    for name in BUILTIN:
        x.logprobs.grad = None
        out, grad = run(name, x)
        assert torch.isfinite(out.loss) and torch.isfinite(grad).all(), name


def test_token_logprobs_temperature_and_shift():
    torch.manual_seed(0)
    logits = torch.randn(5, 7)
    ids = torch.tensor([3, 1, 4, 1, 5])
    temps = torch.full((5,), 0.7)
    lp = token_logprobs(logits, ids, temps)
    ref = torch.log_softmax(logits / 0.7, -1)
    assert lp[0] == 0
    for t in range(1, 5):
        assert lp[t].item() == pytest.approx(ref[t - 1, ids[t]].item(), abs=1e-6)
    ent = token_entropy(logits, temps, chunk=2)
    assert ent[2].item() == pytest.approx(-(ref[1].exp() * ref[1]).sum().item(), abs=1e-6)


def _custom(x: LossInputs, cfg: LossConfig) -> LossOutput:
    return LossOutput(-(x.logprobs * x.advantages)[x.loss_mask].sum(), {"custom_metric": x.loss_mask.sum().float()})


def test_custom_loss_by_import_path():
    fn = get_loss_fn(LossConfig(type="custom", custom=f"{__name__}:_custom"))
    out = fn(make_inputs(), LossConfig())
    assert out.loss.item() == pytest.approx(-(-1 - 2 + 1 + 1))
    with pytest.raises(UserError, match="cannot import custom loss"):
        get_loss_fn(LossConfig(type="custom", custom="no.such.module:fn"))
    with pytest.raises(UserError, match="module.path:function"):
        get_loss_fn(LossConfig(type="custom", custom="just_a_name"))


def _row(lengths, temps, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (sum(lengths),), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])
    t = torch.cat([torch.full((n,), tt) for n, tt in zip(lengths, temps)])
    return ids, pos, t


def test_packed_logprobs_equal_samples_alone(tiny_model):
    lengths, temps = [7, 5, 9], [1.0, 0.6, 1.3]
    ids, pos, t = _row(lengths, temps)
    with torch.no_grad():
        packed = token_logprobs(
            tiny_model(input_ids=ids[None], position_ids=pos[None], use_cache=False).logits[0], ids, t
        )
        start = 0
        for n in lengths:
            sl = slice(start, start + n)
            alone_logits = tiny_model(input_ids=ids[None, sl], use_cache=False).logits[0]
            alone = token_logprobs(alone_logits, ids[sl], t[sl])
            # a sample's first token has no prefix inside its own sample: skip it
            assert torch.allclose(packed[start + 1 : start + n], alone[1:], atol=1e-5)
            start += n


def test_same_weights_give_ratio_one_and_zero_kl(tiny_model):
    lengths = [6, 8]
    ids, pos, t = _row(lengths, [1.0, 0.8], seed=1)
    with torch.no_grad():
        mu = token_logprobs(tiny_model(input_ids=ids[None], position_ids=pos[None], use_cache=False).logits[0], ids, t)
    logits = tiny_model(input_ids=ids[None], position_ids=pos[None], use_cache=False).logits[0]
    lp = token_logprobs(logits, ids, t)
    seg = segments(pos)
    sample_ids, n = seg.sample_ids, seg.num_samples
    mask = pos >= 2
    x = LossInputs(lp, mu, torch.ones_like(lp), mask, sample_ids, n)
    ratio = torch.exp(lp.detach() - mu)[mask]
    assert torch.equal(ratio, torch.ones_like(ratio))
    assert mismatch_kl_sum(x).item() == 0
    assert BUILTIN["aipo"](x, LossConfig()).metrics["masked_frac"].item() == 0


def test_teacher_cross_entropy_hand_computed_and_its_gradient_lowers_the_kl():
    """Row [p, c, c]: targets at positions 1 and 2 (predicted by the logits at 0 and 1), weight 2."""
    torch.manual_seed(0)
    logits = torch.randn(3, 6, requires_grad=True)
    temps = torch.tensor([1.0, 2.0, 2.0])
    ids = torch.tensor([[0, 0], [1, 4], [3, 0]])
    q1, q2 = torch.tensor([0.75, 0.25]), torch.tensor([1.0, 0.0])  # position 2 lists one token (padding: 0)
    targets = torch.stack([torch.zeros(2), 2 * q1, 2 * q2])
    ce, kl = teacher_cross_entropy(logits, temps, ids, targets)
    lp0, lp1 = (torch.log_softmax(logits[i].detach() / 2.0, -1) for i in (0, 1))
    want_ce = -(2 * (0.75 * lp0[1] + 0.25 * lp0[4]) + 2 * lp1[3])
    want_kl = 0.75 * (math.log(0.75) - lp0[1]) + 0.25 * (math.log(0.25) - lp0[4]) + (0.0 - lp1[3])
    assert ce.item() == pytest.approx(want_ce.item(), rel=1e-5) and kl.item() == pytest.approx(want_kl.item(), rel=1e-5)
    ce.backward()
    assert logits.grad[2].abs().sum() == 0  # the last position predicts nothing
    with torch.no_grad():
        _, after = teacher_cross_entropy(logits - 0.5 * logits.grad, temps, ids, targets)
    assert after < kl


def test_teacher_cross_entropy_reads_logit_parents_and_stacked_rows():
    """Rows stacked [2, L, V]: the same value as one row at a time; with parents, the parent's logits."""
    torch.manual_seed(1)
    logits = torch.randn(2, 4, 5)
    temps = torch.ones(2, 4)
    ids = torch.randint(0, 5, (2, 4, 3))
    targets = torch.rand(2, 4, 3) * torch.tensor([0.0, 1.0, 1.0, 1.0])[None, :, None]
    both = teacher_cross_entropy(logits, temps, ids, targets)
    alone = [teacher_cross_entropy(logits[r], temps[r], ids[r], targets[r]) for r in range(2)]
    assert both[0].item() == pytest.approx(sum(a[0].item() for a in alone), rel=1e-5)
    parents = torch.tensor([[-1, 0, 1, 2], [-1, 0, 0, 0]])  # row 1: every token predicted by position 0
    shared, _ = teacher_cross_entropy(logits, temps, ids, targets, parents)
    lp = torch.log_softmax(logits[1, 0], -1)
    row1 = -sum((targets[1, t] * lp[ids[1, t]]).sum() for t in (1, 2, 3))
    assert shared.item() == pytest.approx(alone[0][0].item() + row1.item(), rel=1e-5)
