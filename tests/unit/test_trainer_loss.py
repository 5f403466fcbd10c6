"""Each loss against hand-computed values and gradients on a 2-sample packed row; logprob plumbing."""

import math

import pytest
import torch

from asyncrl.config.trainer import LossConfig
from asyncrl.trainer.loss import (
    BUILTIN,
    LossInputs,
    LossOutput,
    get_loss_fn,
    mismatch_kl_sum,
    token_entropy,
    token_logprobs,
)
from asyncrl.transport.prefix import segments
from asyncrl.utils.errors import UserError

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


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


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
