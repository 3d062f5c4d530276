"""The objectives of issue 29 in rallyrl.ops, against values computed by hand (in the comments):
GSPO's sequence ratio, dual-clip PPO, CISPO, DAPO's group-spread test and its overlong penalty. Each on
an action mask with a hole and garbage (nan) at the positions the mask leaves out."""

from __future__ import annotations

import math

import pytest
import torch

from rallyrl import ops

NAN = float("nan")


def _leaf(rows):
    return torch.tensor(rows, dtype=torch.float64, requires_grad=True)


# ------------------------------------------------------------------------------------------------
# GSPO: the length-normalised sequence ratio


def test_sequence_log_ratio_is_the_mean_over_action_tokens_and_flows_to_each_token():
    # row 0: action tokens 0, 1, 3 (2 is a hole holding garbage); lp - old = 0.3, -0.6, 0.6 -> mean 0.3 / 3 = 0.1
    # row 1: one action token, lp - old = 0.2 -> 0.2; row 2: no action token -> 0
    lp = _leaf([[-1.0, -2.0, NAN, -0.5], [-0.3, NAN, NAN, NAN], [NAN, NAN, NAN, NAN]])
    old = torch.tensor([[-1.3, -1.4, NAN, -1.1], [-0.5, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    m = torch.tensor([[1, 1, 0, 1], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    out = ops.sequence_log_ratio(lp, old, m)
    assert out[0][m[0]].tolist() == pytest.approx([0.1, 0.1, 0.1])
    assert out[1, 0].item() == pytest.approx(0.2) and out[2].tolist() == [0.0] * 4
    # the token form: d(log s_it)/d lp_it = 1 at each action token, nothing elsewhere (not 1/|y| spread over the row)
    (out * m).sum().backward()
    assert lp.grad.tolist() == m.double().tolist()


def test_gspo_loss_by_hand():
    # row 0: lp - old = 0.2, 0.0 -> s = exp(0.1) = 1.105171; A = +1; clip to [1 - 3e-4, 1 + 4e-4]: 1.0004;
    #   max(-1.105171, -1.0004) = -1.0004 (clipped: no gradient)
    # row 1: lp - old = -1e-4 on both -> s = exp(-1e-4) = 0.99990000; A = -1; inside the clip range:
    #   max(0.9999, 0.9997 -> clipped value 0.9997 * 1) = 0.99990000 (unclipped)
    # seq_mean_token_mean over 2 sequences: (-1.0004 + 0.99990000) / 2
    lp = _leaf([[-1.0, -2.0], [-1.0, -1.0]])
    old = torch.tensor([[-1.2, -2.0], [-0.9999, -0.9999]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]], dtype=torch.float64)
    m = torch.ones(2, 2, dtype=torch.bool)
    loss, stats = ops.policy_loss(lp, old, adv, m, 3e-4, clip_range_high=4e-4, ratio_level="sequence",
                                  aggregation="seq_mean_token_mean")
    s1 = math.exp(-1e-4)
    assert loss.item() == pytest.approx((-1.0004 + s1) / 2, abs=1e-12)
    assert stats["clipfrac"].item() == pytest.approx(0.5)
    assert stats["ratio"].item() == pytest.approx((2 * math.exp(0.1) + 2 * s1) / 4)
    loss.backward()
    # row 0 clipped: 0; row 1: d/d lp_t of (1/2) * (1/2) * sum_t (-A) s_t with d s_t / d lp_t = s -> s / 4
    assert lp.grad.flatten().tolist() == pytest.approx([0.0, 0.0, s1 / 4, s1 / 4])


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_gspo_token_form_equals_the_plain_sequence_ratio(aggregation):
    """With one advantage per sequence, the token form's value and gradient are those of TRL's plain
    sequence ratio (a (B, 1) ratio whose gradient is spread 1/|y| over the row's tokens), for any
    aggregation; here computed the plain way in the test."""
    g = torch.Generator().manual_seed(0)
    lp0 = -torch.rand(3, 5, generator=g, dtype=torch.float64) - 0.1
    old = lp0 + 0.05 * torch.randn(3, 5, generator=g, dtype=torch.float64)
    adv = torch.tensor([[0.7], [-1.3], [0.4]], dtype=torch.float64).expand(3, 5)
    m = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 1, 1, 1], [1, 1, 0, 0, 0]], dtype=torch.bool)
    eps_lo, eps_hi = 0.02, 0.03
    a = lp0.clone().requires_grad_(True)
    loss, _ = ops.policy_loss(a, old, adv, m, eps_lo, clip_range_high=eps_hi, ratio_level="sequence",
                              aggregation=aggregation, max_len=5)
    loss.backward()
    b = lp0.clone().requires_grad_(True)
    seq = ((b - old) * m).sum(1, keepdim=True) / m.sum(1, keepdim=True)  # (B, 1)
    coef = torch.exp(seq)
    per_token = -torch.minimum(coef * adv, coef.clamp(1 - eps_lo, 1 + eps_hi) * adv)  # (B, T)
    plain = ops.aggregate_loss(per_token, m, aggregation, ops.loss_units(m, aggregation).double(), 5)
    plain.backward()
    assert loss.item() == pytest.approx(plain.item(), rel=1e-12)
    assert torch.allclose(a.grad, b.grad, rtol=1e-10, atol=1e-14)
    assert a.grad.abs().sum() > 0


# ------------------------------------------------------------------------------------------------
# dual-clip PPO


def test_dual_clip_by_hand():
    # eps 0.2, c = 3; per token (loss form):
    #   t0: A=-1, r=5:   max(5, 1.2) = 5   -> capped at -c*A = 3 (dual clip; no gradient)
    #   t1: A=-1, r=0.5: max(0.5, 0.8) = 0.8 (the ordinary clip; no gradient); 0.8 < 3
    #   t2: A=+2, r=5:   max(-10, -2.4) = -2.4 (ordinary clip); A > 0: no dual clip
    #   t3: A=-1, r=1.1: max(1.1, 1.1) = 1.1 (unclipped, gradient -A*r = 1.1); 1.1 < 3
    #   t4: a hole with garbage
    # token_mean: (3 + 0.8 - 2.4 + 1.1) / 4 = 0.625; without the dual clip (5 + 0.8 - 2.4 + 1.1) / 4 = 1.125
    lp = _leaf([[math.log(5), math.log(0.5), math.log(5), math.log(1.1), NAN]])
    old = torch.tensor([[0.0, 0.0, 0.0, 0.0, NAN]], dtype=torch.float64)
    adv = torch.tensor([[-1.0, -1.0, 2.0, -1.0, NAN]], dtype=torch.float64)
    m = torch.tensor([[1, 1, 1, 1, 0]], dtype=torch.bool)
    loss, stats = ops.policy_loss(lp, old, adv, m, 0.2, dual_clip=3.0)
    assert loss.item() == pytest.approx(0.625)
    assert stats["clipfrac"].item() == pytest.approx(3 / 4)
    loss.backward()
    assert lp.grad[0].tolist() == pytest.approx([0.0, 0.0, 0.0, 1.1 / 4, 0.0])
    plain, plain_stats = ops.policy_loss(lp.detach(), old, adv, m, 0.2)
    assert plain.item() == pytest.approx(1.125) and plain_stats["clipfrac"].item() == pytest.approx(2 / 4)


def test_dual_clip_with_the_sequence_ratio():
    # one row, A = -1, lp - old = log 4 on both tokens -> s = 4; eps 3e-4 / 4e-4: max(4, 0.9997) = 4; c = 3 -> 3
    lp = _leaf([[math.log(4), math.log(4)]])
    zeros = torch.zeros(1, 2, dtype=torch.float64)
    loss, stats = ops.policy_loss(lp, zeros, -torch.ones(1, 2, dtype=torch.float64), torch.ones(1, 2, dtype=torch.bool),
                                  3e-4, clip_range_high=4e-4, ratio_level="sequence", dual_clip=3.0)
    assert loss.item() == pytest.approx(3.0) and stats["clipfrac"].item() == 1.0


def test_unknown_ratio_level_is_refused():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="unknown ratio level 'seq'"):
        ops.policy_loss(x, x, x, x.bool(), 0.2, ratio_level="seq")


# ------------------------------------------------------------------------------------------------
# CISPO


def test_cispo_by_hand():
    # r = exp(lp - old) = [e^0.5 = 1.648721, e^-1 = 0.367879, 1]; A = [2, -1, 3]; eps_high 0.2, no low bound:
    #   w = sg[min(r, 1.2)] = [1.2, 0.367879, 1.0]
    #   loss per token = -w * A * lp = [-1.2*2*(-1) = 2.4, -0.367879*(-1)*(-2) = -0.735759, -1*3*(-0.5) = 1.5]
    #   token_mean = (2.4 - 0.735759 + 1.5) / 3; d/d lp = -w * A / 3 = [-0.8, 0.367879/3, -1.0]
    lp = _leaf([[-1.0, -2.0, -0.5, NAN]])
    old = torch.tensor([[-1.5, -1.0, -0.5, NAN]], dtype=torch.float64)
    adv = torch.tensor([[2.0, -1.0, 3.0, NAN]], dtype=torch.float64)
    m = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    e = math.exp(-1)
    loss, stats = ops.cispo_loss(lp, old, adv, m, clip_low=None, clip_high=0.2)
    assert loss.item() == pytest.approx((2.4 - 2 * e + 1.5) / 3)
    assert stats["clipfrac"].item() == pytest.approx(1 / 3)
    assert stats["ratio"].item() == pytest.approx((math.exp(0.5) + e + 1) / 3)
    loss.backward()
    # every token keeps a gradient, the clipped one too (PPO's clip would have dropped token 0)
    assert lp.grad[0].tolist() == pytest.approx([-0.8, e / 3, -1.0, 0.0])
    # a lower bound 1 - 0.5: token 1's weight becomes 0.5 -> loss (2.4 - 1.0 + 1.5) / 3, two tokens clipped
    low, low_stats = ops.cispo_loss(lp.detach(), old, adv, m, clip_low=0.5, clip_high=0.2)
    assert low.item() == pytest.approx(2.9 / 3) and low_stats["clipfrac"].item() == pytest.approx(2 / 3)


def test_cispo_global_normaliser_gives_one_gradient_for_any_split():
    g = torch.Generator().manual_seed(1)
    lp0, old = -torch.rand(4, 3, generator=g), -torch.rand(4, 3, generator=g)
    adv = torch.randn(4, 3, generator=g)
    m = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 1, 1]], dtype=torch.bool)
    whole = lp0.clone().requires_grad_(True)
    ops.cispo_loss(whole, old, adv, m, None, 0.2)[0].backward()
    split = lp0.clone().requires_grad_(True)
    n = m.sum()  # the global token count, as the update passes it to each part
    for sl in (slice(0, 1), slice(1, 4)):
        ops.cispo_loss(split[sl], old[sl], adv[sl], m[sl], None, 0.2, num_tokens=n)[0].backward()
    assert torch.allclose(whole.grad, split.grad)


# ------------------------------------------------------------------------------------------------
# DAPO: which groups vary; the overlong penalty


def test_group_spread_by_hand():
    # id 0: [1, 1] equal; id 1: [2, 3] differ; id 2: [3, 3] equal; id 3: no sample; id 4: one sample
    scores = torch.tensor([1.0, 2.0, 1.0, 3.0, 3.0, 3.0, 5.0])
    ids = torch.tensor([0, 1, 0, 1, 2, 2, 4])
    assert ops.group_spread(scores, ids).tolist() == [False, True, False, False, False]
    assert ops.group_spread(torch.tensor([0.0, 1e-12]), torch.tensor([0, 0])).tolist() == [True]
    with pytest.raises(ValueError, match="differ"):
        ops.group_spread(torch.zeros(3), torch.zeros(2, dtype=torch.long))


def test_overlong_penalty_by_hand():
    # max 10, buffer 4: free up to 6 tokens, then -1/4 per token down to -1 at 10 (and beyond)
    lengths = torch.tensor([3, 6, 7, 9, 10, 12])
    assert ops.overlong_penalty(lengths, 10, 4, 1.0).tolist() == [0.0, 0.0, -0.25, -0.75, -1.0, -1.0]
    assert ops.overlong_penalty(lengths, 10, 4, 0.5).tolist() == [0.0, 0.0, -0.125, -0.375, -0.5, -0.5]
    assert ops.overlong_penalty(torch.tensor([0, 5, 10]), 10, 10, 2.0).tolist() == [0.0, -1.0, -2.0]
    with pytest.raises(ValueError, match="overlong buffer 0"):
        ops.overlong_penalty(lengths, 10, 0, 1.0)
