"""Unit tests for rallyrl.ops.

Expected values are worked out by hand (arithmetic in the comments) and
written as literals; reference implementations written here (naive loops,
numpy) are used for the randomised checks.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rallyrl import ops

T_ = True
F_ = False


def close(actual: torch.Tensor | float, expected, atol: float = 1e-6) -> None:
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float64),
        torch.as_tensor(expected, dtype=torch.float64),
        atol=atol,
        rtol=1e-6,
    )


def right_padded_mask(lengths: list[int], T: int) -> torch.Tensor:
    return torch.arange(T).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)  # (B, T)


class Recorder:
    """Fake reduce: records its input, then adds ``other`` (the other 'rank')."""

    def __init__(self, other: torch.Tensor | None = None) -> None:
        self.other = other
        self.calls: list[torch.Tensor] = []

    def __call__(self, v: torch.Tensor) -> torch.Tensor:
        assert v.dim() == 1, "reduce must get one stacked 1-D vector"
        self.calls.append(v.clone())
        return v if self.other is None else v + self.other


def local_vector(fn, *args, **kwargs) -> torch.Tensor:
    """The vector a function would hand to reduce on this 'rank'."""
    rec = Recorder()
    fn(*args, reduce=rec, **kwargs)
    assert len(rec.calls) == 1
    return rec.calls[0]


# --------------------------------------------------------------------------- #
# log-probs / entropy / KL
# --------------------------------------------------------------------------- #
def test_logprobs_match_log_softmax_gather():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g) * 4
    labels = torch.randint(0, 11, (3, 5), generator=g)
    expected = torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    out = ops.logprobs_from_logits(logits, labels)
    assert out.shape == (3, 5)
    torch.testing.assert_close(out, expected)


def test_logprobs_bf16_computed_in_fp32():
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(2, 4, 7, generator=g) * 3).bfloat16()
    labels = torch.randint(0, 7, (2, 4), generator=g)
    out = ops.logprobs_from_logits(logits, labels)
    assert out.dtype == torch.float32
    expected = torch.log_softmax(logits.float(), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(out, expected)


def test_logprobs_gradient_matches_log_softmax():
    g = torch.Generator().manual_seed(2)
    base = torch.randn(2, 3, 6, generator=g)
    labels = torch.randint(0, 6, (2, 3), generator=g)
    a = base.clone().requires_grad_()
    b = base.clone().requires_grad_()
    ops.logprobs_from_logits(a, labels).sum().backward()
    torch.log_softmax(b, -1).gather(-1, labels.unsqueeze(-1)).sum().backward()
    torch.testing.assert_close(a.grad, b.grad)


def test_logprobs_hand_example():
    # logits [0, ln 3] -> p = [1/4, 3/4]; log p(1) = ln 0.75 = -0.2876821
    logits = torch.tensor([[[0.0, math.log(3.0)]]])
    close(ops.logprobs_from_logits(logits, torch.tensor([[1]])), [[-0.2876821]])


def test_entropy_hand_examples():
    logits = torch.tensor(
        [
            [
                [0.0, 0.0, 0.0, 0.0],  # uniform over 4 -> ln 4 = 1.3862944
                [0.0, math.log(3.0), -math.inf, -math.inf],  # p = [.25, .75, 0, 0]
                [5.0, -math.inf, -math.inf, -math.inf],  # deterministic -> 0, not NaN
            ]
        ]
    )
    # row 2: -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.25*1.3862944 + 0.75*0.2876821
    #      = 0.3465736 + 0.2157616 = 0.5623351
    out = ops.entropy_from_logits(logits)
    assert out.shape == (1, 3)
    close(out, [[1.3862944, 0.5623351, 0.0]])


def test_entropy_bf16_matches_fp32():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 3, 9, generator=g).bfloat16()
    out = ops.entropy_from_logits(logits)
    assert out.dtype == torch.float32
    p = torch.softmax(logits.float(), -1)
    torch.testing.assert_close(out, -(p * p.log()).sum(-1))


def test_kl_estimators_hand_values():
    # lp = ln 0.5, ref = ln 0.25: lp - ref = ln 2 = 0.6931472
    lp = torch.tensor([[math.log(0.5), math.log(0.3)]])
    ref = torch.tensor([[math.log(0.25), math.log(0.3)]])
    # k1 = ln 2 = 0.6931472 ; identical probs -> 0
    close(ops.kl_estimate(lp, ref, "k1"), [[0.6931472, 0.0]])
    # k2 = 0.5 * (ln 2)^2 = 0.5 * 0.4804530 = 0.2402265
    close(ops.kl_estimate(lp, ref, "k2"), [[0.2402265, 0.0]])
    # k3: log r = ref - lp = -ln 2; exp(-ln 2) - 1 - (-ln 2) = 0.5 - 1 + 0.6931472 = 0.1931472
    close(ops.kl_estimate(lp, ref, "k3"), [[0.1931472, 0.0]])
    # default is k1
    close(ops.kl_estimate(lp, ref), [[0.6931472, 0.0]])


def test_kl_k1_can_be_negative_k3_cannot():
    # lp - ref = ln 0.25 - ln 0.5 = -ln 2 -> k1 = -0.6931472
    lp, ref = torch.tensor([math.log(0.25)]), torch.tensor([math.log(0.5)])
    close(ops.kl_estimate(lp, ref, "k1"), [-0.6931472])
    # k3: log r = ln 2 -> 2 - 1 - 0.6931472 = 0.3068528
    close(ops.kl_estimate(lp, ref, "k3"), [0.3068528])


def test_kl_unknown_estimator_message():
    with pytest.raises(ValueError) as err:
        ops.kl_estimate(torch.zeros(1), torch.zeros(1), "k4")
    msg = str(err.value)
    assert "'k4'" in msg
    for name in ("k1", "k2", "k3"):
        assert name in msg


# --------------------------------------------------------------------------- #
# masked reductions
# --------------------------------------------------------------------------- #
X = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, math.nan]])
M = torch.tensor([[T_, T_, T_], [T_, F_, F_]])


def test_masked_sum_and_mean():
    close(ops.masked_sum(X, M), 10.0)  # 1+2+3+4, garbage/NaN padding ignored
    close(ops.masked_sum(X, M, dim=1), [6.0, 4.0])
    close(ops.masked_mean(X, M), 2.5)  # 10/4
    close(ops.masked_mean(X, M, dim=1), [2.0, 4.0])  # 6/3, 4/1
    close(ops.masked_mean(X, M, dim=0), [2.5, 2.0, 3.0])  # (1+4)/2, 2/1, 3/1


def test_masked_ops_accept_01_mask():
    close(ops.masked_mean(X, M.long()), 2.5)
    close(ops.masked_sum(X, M.float(), dim=1), [6.0, 4.0])


def test_masked_mean_empty_rows_are_zero():
    x = torch.tensor([[1.0, 2.0], [math.inf, math.nan]])
    m = torch.tensor([[T_, T_], [F_, F_]])
    out = ops.masked_mean(x, m, dim=1)
    close(out, [1.5, 0.0])
    assert torch.isfinite(out).all()
    close(ops.masked_mean(x, torch.zeros_like(m)), 0.0)


def test_masked_moments_hand_values():
    # elements 1,2,3,4: mean 2.5; squared deviations 2.25+0.25+0.25+2.25 = 5
    mean, var, count = ops.masked_moments(X, M)
    close(mean, 2.5)
    close(var, 5.0 / 3.0)  # unbiased: 5 / (4 - 1) = 1.6666667
    close(count, 4.0)
    assert mean.dtype == torch.float32 and count.dtype == torch.float64
    _, var_pop, _ = ops.masked_moments(X, M, unbiased=False)
    close(var_pop, 1.25)  # 5 / 4


def test_masked_moments_single_and_empty():
    # one element: Bessel not applied (count = 1) -> var 0
    mean, var, count = ops.masked_moments(torch.tensor([7.0, 1.0]), torch.tensor([T_, F_]))
    close(mean, 7.0)
    close(var, 0.0)
    close(count, 1.0)
    mean, var, count = ops.masked_moments(torch.tensor([7.0]), torch.tensor([F_]))
    close(torch.stack([mean, var]), [0.0, 0.0])
    close(count, 0.0)


def test_masked_moments_float64_stability():
    # large offset + small spread: float32 sum-of-squares would lose it all
    x = torch.tensor([1e4 + 0.1, 1e4 + 0.2, 1e4 + 0.3], dtype=torch.float32)
    _, var, _ = ops.masked_moments(x, torch.ones(3, dtype=torch.bool))
    # deviations of the float32-rounded inputs are ~±0.1 -> var ~ 0.01
    close(var, float(np.var(x.double().numpy(), ddof=1)), atol=1e-6)


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.floats(-100, 100), min_size=1, max_size=24),
    st.integers(0, 2**31 - 1),
)
def test_masked_moments_match_numpy(values, seed):
    x = torch.tensor(values, dtype=torch.float64)
    m = torch.rand(len(values), generator=torch.Generator().manual_seed(seed)) < 0.6
    sel = np.asarray(values)[m.numpy()]
    mean, var, count = ops.masked_moments(x, m)
    assert count.item() == len(sel)
    if len(sel) == 0:
        assert mean.item() == 0.0 and var.item() == 0.0
        return
    np.testing.assert_allclose(mean.item(), sel.mean(), atol=1e-9)
    expected_var = sel.var(ddof=1) if len(sel) > 1 else 0.0
    np.testing.assert_allclose(var.item(), expected_var, atol=1e-7, rtol=1e-7)


def _two_rank_split():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, 5, generator=g) * 3 + 1
    m = right_padded_mask([5, 0, 3, 1, 4, 2], 5)
    return x, m, (x[:2], m[:2]), (x[2:], m[2:])  # rank A gets 2 rows, B gets 4


def test_masked_moments_reduce_equals_full_batch():
    x, m, (xa, ma), (xb, mb) = _two_rank_split()
    full = ops.masked_moments(x, m)
    vec_a = local_vector(ops.masked_moments, xa, ma)
    vec_b = local_vector(ops.masked_moments, xb, mb)
    # each "rank" adds the other's vector: both must see the full-batch result
    rec_a, rec_b = Recorder(other=vec_b), Recorder(other=vec_a)
    out_a = ops.masked_moments(xa, ma, reduce=rec_a)
    out_b = ops.masked_moments(xb, mb, reduce=rec_b)
    for out in (out_a, out_b):
        for got, want in zip(out, full):
            torch.testing.assert_close(got, want)
    assert len(rec_a.calls) == 1 and len(rec_b.calls) == 1  # ONE reduce per call
    # local stats differ from global ones (so the test is not vacuous)
    assert not torch.allclose(ops.masked_moments(xa, ma)[0], full[0])


def test_masked_whiten_hand_values():
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0, 50.0]])
    m = torch.tensor([[T_, T_, T_, T_, F_]])
    # mean 2.5, unbiased var 5/3, 1/std = sqrt(3/5) = 0.7745967
    # (-1.5, -0.5, 0.5, 1.5) * 0.7745967 = (-1.1618950, -0.3872983, 0.3872983, 1.1618950)
    out = ops.masked_whiten(x, m)
    close(out, [[-1.1618950, -0.3872983, 0.3872983, 1.1618950, 0.0]])
    assert out.dtype == torch.float32
    # shift_mean=False adds the mean 2.5 back (padding stays 0)
    close(
        ops.masked_whiten(x, m, shift_mean=False),
        [[1.3381050, 2.1127017, 2.8872983, 3.6618950, 0.0]],
    )


def test_masked_whiten_keeps_dtype_and_empty_mask():
    x = torch.tensor([[1.0, 2.0]], dtype=torch.float64)
    assert ops.masked_whiten(x, torch.ones(1, 2, dtype=torch.bool)).dtype == torch.float64
    out = ops.masked_whiten(torch.tensor([[3.0, math.nan]]), torch.tensor([[F_, F_]]))
    close(out, [[0.0, 0.0]])


def test_masked_whiten_reduce_equals_full_batch():
    x, m, (xa, ma), (xb, mb) = _two_rank_split()
    full = ops.masked_whiten(x, m, shift_mean=False)
    vec_a = local_vector(ops.masked_whiten, xa, ma, shift_mean=False)
    vec_b = local_vector(ops.masked_whiten, xb, mb, shift_mean=False)
    rec_a = Recorder(other=vec_b)
    out_a = ops.masked_whiten(xa, ma, shift_mean=False, reduce=rec_a)
    out_b = ops.masked_whiten(xb, mb, shift_mean=False, reduce=Recorder(other=vec_a))
    torch.testing.assert_close(torch.cat([out_a, out_b]), full)
    assert len(rec_a.calls) == 1


# --------------------------------------------------------------------------- #
# rewards and GAE
# --------------------------------------------------------------------------- #
def test_penalized_rewards_hand_example():
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6], [0.7, 0.8, 0.9]])
    mask = torch.tensor([[T_, T_, T_], [T_, F_, F_], [F_, F_, F_]])
    scores = torch.tensor([1.0, 2.0, 5.0])
    out = ops.penalized_rewards(kl, mask, kl_coef=0.5, scores=scores)
    # row 0: -0.5*[0.1, 0.2, 0.3] = [-0.05, -0.1, -0.15]; +1.0 on last -> 0.85
    # row 1: -0.5*0.4 = -0.2, +2.0 on its only token -> 1.8; padding 0
    # row 2: empty response -> nothing, the score 5.0 is dropped
    close(out, [[-0.05, -0.1, 0.85], [1.8, 0.0, 0.0], [0.0, 0.0, 0.0]])


def test_penalized_rewards_dense_and_no_scores():
    kl = torch.tensor([[0.2, 0.4, math.nan]])
    mask = torch.tensor([[T_, T_, F_]])
    dense = torch.tensor([[1.0, 0.0, 9.0]])
    # kl_coef 0.1: [-0.02, -0.04, pad]; dense adds [1, 0] on real tokens, 9 dropped
    close(ops.penalized_rewards(kl, mask, 0.1, dense_scores=dense), [[0.98, -0.04, 0.0]])
    close(ops.penalized_rewards(kl, mask, 0.1), [[-0.02, -0.04, 0.0]])
    # both: score 3 on the last real token (t = 1): -0.04 + 3 = 2.96
    close(
        ops.penalized_rewards(kl, mask, 0.1, scores=torch.tensor([3.0]), dense_scores=dense),
        [[0.98, 2.96, 0.0]],
    )


def test_gae_hand_example_full_row():
    rewards = torch.tensor([[1.0, 0.0, 2.0]])
    values = torch.tensor([[0.5, 1.0, 1.5]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    adv, ret = ops.gae(rewards, values, mask, gamma=0.9, lam=0.5)
    # gamma*lam = 0.45; value after the last token is 0
    # t=2: delta = 2 + 0.9*0   - 1.5 = 0.5   ; A2 = 0.5
    # t=1: delta = 0 + 0.9*1.5 - 1.0 = 0.35  ; A1 = 0.35 + 0.45*0.5   = 0.575
    # t=0: delta = 1 + 0.9*1.0 - 0.5 = 1.4   ; A0 = 1.4  + 0.45*0.575 = 1.65875
    close(adv, [[1.65875, 0.575, 0.5]])
    # returns = A + V = [1.65875+0.5, 0.575+1.0, 0.5+1.5]
    close(ret, [[2.15875, 1.575, 2.0]])


def test_gae_hand_example_padded_row():
    # padding holds garbage that must not be bootstrapped from
    rewards = torch.tensor([[1.0, 2.0, 99.0]])
    values = torch.tensor([[0.5, 1.0, 7.0]])
    mask = torch.tensor([[T_, T_, F_]])
    adv, ret = ops.gae(rewards, values, mask, gamma=0.9, lam=0.5)
    # t=1 (last real): delta = 2 + 0.9*0 - 1.0 = 1.0 ; A1 = 1.0
    # t=0: delta = 1 + 0.9*1.0 - 0.5 = 1.4 ; A0 = 1.4 + 0.45*1.0 = 1.85
    close(adv, [[1.85, 1.0, 0.0]])
    close(ret, [[2.35, 2.0, 0.0]])  # [1.85+0.5, 1.0+1.0, 0]


def naive_gae(rewards, values, mask, gamma, lam):
    """Per row, per t: textbook GAE on the real prefix only."""
    B, T = rewards.shape
    adv = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        n = int(mask[b].sum())
        for t in range(n):
            a = 0.0
            for k in range(t, n):  # A_t = sum_k (gamma*lam)^(k-t) delta_k
                v_next = values[b, k + 1].item() if k + 1 < n else 0.0
                delta = rewards[b, k].item() + gamma * v_next - values[b, k].item()
                a += (gamma * lam) ** (k - t) * delta
            adv[b, t] = a
    ret = torch.where(mask, adv + values.double(), torch.zeros((), dtype=torch.float64))
    return adv, ret


def test_gae_vectorised_matches_naive_loop():
    g = torch.Generator().manual_seed(5)
    B, T = 7, 9
    rewards = torch.randn(B, T, generator=g, dtype=torch.float64)
    values = torch.randn(B, T, generator=g, dtype=torch.float64)
    lengths = [0, T] + torch.randint(1, T, (B - 2,), generator=g).tolist()
    mask = right_padded_mask(lengths, T)
    rewards[~mask] = 1e6  # garbage on padding
    values[~mask] = -1e6
    for gamma, lam in [(1.0, 0.95), (0.9, 0.5), (0.99, 1.0), (0.5, 0.0)]:
        adv, ret = ops.gae(rewards, values, mask, gamma, lam)
        ref_adv, ref_ret = naive_gae(rewards, values, mask, gamma, lam)
        torch.testing.assert_close(adv, ref_adv)
        torch.testing.assert_close(ret, ref_ret)
    assert (adv[0] == 0).all() and (ret[0] == 0).all()  # empty row


# --------------------------------------------------------------------------- #
# losses
# --------------------------------------------------------------------------- #
def _policy_inputs():
    # ratios r = [1.5, 0.5, 1.1] (old = 0), advantages [1, 1, -1], eps 0.2; 4th token is padding
    lp = torch.tensor([[math.log(1.5), math.log(0.5), math.log(1.1), math.inf]], requires_grad=True)
    old = torch.zeros(1, 4)
    adv = torch.tensor([[1.0, 1.0, -1.0, math.nan]])
    mask = torch.tensor([[T_, T_, T_, F_]])
    return lp, old, adv, mask


def test_policy_loss_hand_example():
    lp, old, adv, mask = _policy_inputs()
    loss, stats = ops.policy_loss(lp, old, adv, mask, clip_range=0.2)
    # tok0: A=1,  r=1.5: max(-1.5, -clip(1.5)=-1.2) = -1.2  (clipped branch active)
    # tok1: A=1,  r=0.5: max(-0.5, -clip(0.5)=-0.8) = -0.5  (unclipped)
    # tok2: A=-1, r=1.1: max( 1.1,  clip(1.1)= 1.1) =  1.1  (inside the range)
    # sum = -1.2 - 0.5 + 1.1 = -0.6 ; / 3 tokens = -0.2
    close(loss, -0.2)
    close(stats["clipfrac"], 1.0 / 3.0)
    close(stats["ratio"], 3.1 / 3.0)  # (1.5 + 0.5 + 1.1) / 3 = 1.0333333
    # approx_kl = 0.5 * mean((ln r)^2) = 0.5 * (0.1644019 + 0.4804530 + 0.0090840) / 3 = 0.1089898
    close(stats["approx_kl"], 0.1089898)
    for s in stats.values():
        assert s.dim() == 0 and not s.requires_grad
    # gradients: d(-A r)/d lp = -A r ; the clipped token gets 0 ; / 3
    loss.backward()
    close(lp.grad, [[0.0, -0.5 / 3.0, 1.1 / 3.0, 0.0]])


def test_policy_loss_num_tokens_normaliser():
    lp, old, adv, mask = _policy_inputs()
    loss, _ = ops.policy_loss(lp, old, adv, mask, clip_range=0.2, num_tokens=6)
    close(loss, -0.1)  # -0.6 / 6
    loss, _ = ops.policy_loss(lp, old, adv, mask, clip_range=0.2, num_tokens=torch.tensor(4.0))
    close(loss, -0.15)  # -0.6 / 4


def test_policy_loss_global_normaliser_two_ranks_same_gradient():
    g = torch.Generator().manual_seed(6)
    B, T = 4, 5
    base = torch.randn(B, T, generator=g) * 0.3
    old = torch.randn(B, T, generator=g) * 0.3
    adv = torch.randn(B, T, generator=g)
    mask = right_padded_mask([5, 1, 3, 0], T)
    full = base.clone().requires_grad_()
    ops.policy_loss(full, old, adv, mask, 0.2)[0].backward()
    # two "ranks" with uneven token counts (6 vs 3), normalised by the global 9,
    # gradients summed (what an all-reduce SUM of grads does)
    halves = [base[:2].clone().requires_grad_(), base[2:].clone().requires_grad_()]
    n_global = mask.sum()
    for part, sl in zip(halves, (slice(0, 2), slice(2, 4))):
        ops.policy_loss(part, old[sl], adv[sl], mask[sl], 0.2, num_tokens=n_global)[0].backward()
    torch.testing.assert_close(torch.cat([h.grad for h in halves]), full.grad)


def test_policy_loss_empty_mask_is_zero():
    lp = torch.zeros(2, 3, requires_grad=True)
    loss, stats = ops.policy_loss(lp, torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3, dtype=torch.bool), 0.2)
    close(loss, 0.0)
    for s in stats.values():
        close(s, 0.0)


def test_value_loss_hand_example():
    values = torch.tensor([[1.5, 0.9, 1.5, math.nan]], requires_grad=True)
    old = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    returns = torch.tensor([[2.0, 0.0, 0.5, 0.0]])
    mask = torch.tensor([[T_, T_, T_, F_]])
    loss, stats = ops.value_loss(values, old, returns, mask, clip_range_value=0.2)
    # tok0: (1.5-2)^2 = 0.25 ; clip(1.5, 0.8, 1.2) = 1.2 -> (1.2-2)^2 = 0.64 ; max 0.64 (clipped)
    # tok1: (0.9-0)^2 = 0.81 ; 0.9 is inside [0.8, 1.2]  -> 0.81       ; max 0.81
    # tok2: (1.5-0.5)^2 = 1.0 ; clip -> 1.2 -> (1.2-0.5)^2 = 0.49      ; max 1.0 (unclipped)
    # loss = 0.5 * (0.64 + 0.81 + 1.0) / 3 = 0.5 * 2.45 / 3 = 0.4083333
    close(loss, 0.4083333)
    close(stats["clipfrac"], 1.0 / 3.0)
    close(stats["error"], 2.06 / 3.0)  # (0.25 + 0.81 + 1.0) / 3 = 0.6866667
    loss.backward()
    # grads: tok0 clipped -> 0 ; tok1 (v-R)/3 = 0.9/3 = 0.3 ; tok2 (1.5-0.5)/3 = 0.3333333
    close(values.grad, [[0.0, 0.3, 1.0 / 3.0, 0.0]])
    loss6, _ = ops.value_loss(values, old, returns, mask, 0.2, num_tokens=6.0)
    close(loss6, 0.2041667)  # 0.5 * 2.45 / 6


# --------------------------------------------------------------------------- #
# KL controllers
# --------------------------------------------------------------------------- #
def test_fixed_kl_controller():
    ctl = ops.FixedKLController(0.05)
    ctl.update(current_kl=100.0, n_steps=10)
    assert ctl.value == 0.05
    sd = json.loads(json.dumps(ctl.state_dict()))
    other = ops.FixedKLController(1.0)
    other.load_state_dict(sd)
    assert other.value == 0.05


@pytest.mark.parametrize(
    "kl, expected",
    [
        (9.0, 0.102),  # 9/6 - 1 = 0.5 -> clipped 0.2 ; 0.1 * (1 + 0.2*10/100) = 0.102
        (3.0, 0.098),  # 3/6 - 1 = -0.5 -> clipped -0.2 ; 0.1 * (1 - 0.02) = 0.098
        (6.6, 0.101),  # 6.6/6 - 1 = 0.1 (inside) ; 0.1 * (1 + 0.1*10/100) = 0.101
        (6.0, 0.1),  # on target -> unchanged
    ],
)
def test_adaptive_kl_controller_update(kl, expected):
    ctl = ops.AdaptiveKLController(init_kl_coef=0.1, target=6.0, horizon=100)
    ctl.update(kl, n_steps=10)
    assert ctl.value == pytest.approx(expected, abs=1e-12)


def test_adaptive_kl_controller_state_roundtrip():
    ctl = ops.AdaptiveKLController(0.1, 6.0, 100)
    ctl.update(9.0, 10)  # -> 0.102
    sd = json.loads(json.dumps(ctl.state_dict()))
    resumed = ops.AdaptiveKLController(1.0, 1.0, 1)
    resumed.load_state_dict(sd)
    ctl.update(3.0, 10)
    resumed.update(3.0, 10)
    assert resumed.value == ctl.value == pytest.approx(0.102 * 0.98)  # 0.09996


# --------------------------------------------------------------------------- #
# RunningMoments
# --------------------------------------------------------------------------- #
def _reward_batches():
    rng = np.random.default_rng(7)
    return [rng.normal(3.0, 2.0, size=n) for n in (5, 1, 12, 8)]


def test_running_moments_match_numpy_on_concatenation():
    rm = ops.RunningMoments()
    assert (rm.mean, rm.std) == (0.0, 1.0)
    seen: list[np.ndarray] = []
    for batch in _reward_batches():
        b_mean, b_std = rm.update(torch.tensor(batch, dtype=torch.float32))
        seen.append(batch.astype(np.float32).astype(np.float64))
        allx = np.concatenate(seen)
        cur = seen[-1]
        assert b_mean == pytest.approx(cur.mean(), abs=1e-9)
        assert b_std == pytest.approx(cur.std(ddof=1) if len(cur) > 1 else 0.0, abs=1e-9)
        assert rm.count == len(allx)
        assert rm.mean == pytest.approx(allx.mean(), abs=1e-9)
        assert rm.var == pytest.approx(allx.var(), abs=1e-9)
        assert rm.std == pytest.approx(allx.std(ddof=1), abs=1e-9)
    assert all(isinstance(v, float) for v in (rm.mean, rm.std, rm.var, rm.count))


def test_running_moments_hand_example():
    rm = ops.RunningMoments()
    # batch [1, 3]: mean 2, population var 1, unbiased std sqrt(2) = 1.4142136
    assert rm.update(torch.tensor([1.0, 3.0])) == pytest.approx((2.0, 1.4142136))
    # batch [5]: all = [1, 3, 5] -> mean 3 ; pop var (4+0+4)/3 = 2.6666667 ; std sqrt(8/2) = 2
    assert rm.update(torch.tensor([5.0])) == pytest.approx((5.0, 0.0))
    assert (rm.mean, rm.var, rm.std, rm.count) == pytest.approx((3.0, 8.0 / 3.0, 2.0, 3.0))


def test_running_moments_resume_is_exact():
    batches = [torch.tensor(b) for b in _reward_batches()]
    rm = ops.RunningMoments()
    for b in batches[:2]:
        rm.update(b)
    resumed = ops.RunningMoments()
    resumed.load_state_dict(json.loads(json.dumps(rm.state_dict())))
    for b in batches[2:]:
        assert rm.update(b) == resumed.update(b)
    assert rm.state_dict() == resumed.state_dict()


def test_running_moments_reduce_two_ranks():
    xs = torch.tensor(_reward_batches()[2])  # 12 values
    xa, xb = xs[:5], xs[5:]
    single = ops.RunningMoments()
    expected = single.update(xs)
    vec_b = local_vector(ops.RunningMoments().update, xb)
    rec = Recorder(other=vec_b)
    rank_a = ops.RunningMoments()
    got = rank_a.update(xa, reduce=rec)
    assert len(rec.calls) == 1
    assert got == pytest.approx(expected, abs=1e-12)
    assert rank_a.state_dict() == pytest.approx(single.state_dict(), abs=1e-12)


def test_running_moments_empty_batch_is_noop():
    rm = ops.RunningMoments()
    rm.update(torch.tensor([1.0, 2.0]))
    before = rm.state_dict()
    assert rm.update(torch.tensor([])) == (0.0, 0.0)
    assert rm.state_dict() == before
