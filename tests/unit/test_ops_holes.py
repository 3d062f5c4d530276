"""Every masked function of rallyrl.ops on an action mask WITH HOLES, against values worked out by hand.

A hole is a token in the context that the policy did not sample (a tool result, an environment
message between two turns): ``action_mask`` is False there, as on padding. E.g. ``[1 1 1 0 0 1 1 0 0]``
is turn 1 (3 action tokens), 2 environment tokens, turn 2 (2 action tokens), then padding. The
semantics checked here (the package docstring of ``rallyrl.ops`` states them):

* statistics, whitening, loss aggregation, policy/value losses, KL: a hole is not counted;
* ``penalized_rewards``: the score goes on the LAST action token (the last True), KL and dense
  rewards count on action tokens only;
* ``gae``: the chain runs over the action tokens in order, a hole is skipped (not the end of the
  episode), the last action token bootstraps with 0, advantages and returns at holes are 0.

Holes and padding hold garbage (nan/inf/large numbers) that must never reach a result.
"""

from __future__ import annotations

import math

import pytest
import torch

from rallyrl import ops

NAN, INF = math.nan, math.inf


def close(actual, expected, atol: float = 1e-6) -> None:
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float64),
                               torch.as_tensor(expected, dtype=torch.float64), atol=atol, rtol=1e-6)


def mask_of(*rows: str) -> torch.Tensor:
    """``mask_of("111001100")`` -> a (B, T) bool mask, one string per row."""
    return torch.tensor([[c == "1" for c in row] for row in rows])


# --------------------------------------------------------------------------- #
# masked statistics and whitening
# --------------------------------------------------------------------------- #
# row 0: turn, 2 env tokens, turn, padding; row 1 starts with a hole, two holes; row 2 all holes
M_H = mask_of("111001100", "010100000", "000000000")
X_H = torch.tensor([
    [1.0, 2.0, 3.0, 50.0, NAN, 4.0, 5.0, 99.0, INF],
    [NAN, 4.0, -INF, 2.0, 7.0, 7.0, 7.0, 7.0, 7.0],
    [NAN, INF, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0],
])
# action values: 1 2 3 4 5 | 4 2 ; sum 21, count 7, mean 3
# deviations -2 -1 0 1 2 | 1 -1 ; squares 4 1 0 1 4 | 1 1 = 12 ; unbiased var 12/6 = 2, population 12/7


def test_masked_sum_and_mean_skip_holes():
    close(ops.masked_sum(X_H, M_H), 21.0)
    close(ops.masked_sum(X_H, M_H, dim=1), [15.0, 6.0, 0.0])
    close(ops.masked_mean(X_H, M_H), 3.0)
    close(ops.masked_mean(X_H, M_H, dim=1), [3.0, 3.0, 0.0])  # 15/5, 6/2, all-holes row -> 0 (no NaN)


def test_masked_moments_skip_holes():
    mean, var, count = ops.masked_moments(X_H, M_H)
    close(mean, 3.0)
    close(var, 2.0)
    close(count, 7.0)
    close(ops.masked_moments(X_H, M_H, unbiased=False)[1], 12.0 / 7.0)  # 1.7142857


def test_masked_moments_with_holes_reduce_over_two_ranks():
    full = ops.masked_moments(X_H, M_H)
    parts = [(X_H[:1], M_H[:1]), (X_H[1:], M_H[1:])]
    vecs = []
    for x, m in parts:
        ops.masked_moments(x, m, reduce=lambda v: vecs.append(v.clone()) or v)
    # rank 0: [15, 1+4+9+16+25 = 55, 5]; rank 1: [6, 16+4 = 20, 2]
    close(vecs[0], [15.0, 55.0, 5.0])
    close(vecs[1], [6.0, 20.0, 2.0])
    out = ops.masked_moments(parts[0][0], parts[0][1], reduce=lambda v: v + vecs[1])
    for got, want in zip(out, full):
        torch.testing.assert_close(got, want)


def test_masked_whiten_excludes_holes_and_leaves_them_zero():
    out = ops.masked_whiten(X_H, M_H)
    # (x - 3) / sqrt(2): 1 -> -1.4142136, 2 -> -0.7071068, 3 -> 0, 4 -> 0.7071068, 5 -> 1.4142136
    s = 1.0 / math.sqrt(2.0)
    close(out, [
        [-2 * s, -s, 0.0, 0.0, 0.0, s, 2 * s, 0.0, 0.0],
        [0.0, s, 0.0, -s, 0.0, 0.0, 0.0, 0.0, 0.0],
        [0.0] * 9,
    ])
    assert torch.isfinite(out).all()
    # shift_mean=False adds the mean 3 back on action tokens; holes stay 0
    close(ops.masked_whiten(X_H, M_H, shift_mean=False), [
        [3 - 2 * s, 3 - s, 3.0, 0.0, 0.0, 3 + s, 3 + 2 * s, 0.0, 0.0],
        [0.0, 3 + s, 0.0, 3 - s, 0.0, 0.0, 0.0, 0.0, 0.0],
        [0.0] * 9,
    ])


# --------------------------------------------------------------------------- #
# KL, loss aggregation, policy and value losses
# --------------------------------------------------------------------------- #
def test_kl_over_action_tokens_only():
    # token 1 is a hole whose (garbage) log-probs differ a lot; tokens 0 and 2 are actions
    lp = torch.tensor([[math.log(0.5), math.log(0.9), math.log(0.3)]])
    ref = torch.tensor([[math.log(0.25), math.log(0.001), math.log(0.3)]])
    m = mask_of("101")
    kl = ops.kl_estimate(lp, ref, "k1")
    close(ops.masked_mean(kl, m), math.log(2.0) / 2)  # (ln 2 + 0) / 2 = 0.3465736
    # as the trainer's KL loss: token_mean over 2 action tokens
    close(ops.aggregate_loss(torch.where(m, kl, 0.0), m, "token_mean", ops.loss_units(m, "token_mean")),
          math.log(2.0) / 2)


# row 0: actions 1 2 3 | 4 5 (sum 15 over 5 tokens); row 1: hole, 4, hole, 8 (sum 12 over 2); row 2: all holes
PER_TOKEN_H = torch.tensor([
    [1.0, 2.0, 3.0, 100.0, NAN, 4.0, 5.0, 9.0, 9.0],
    [INF, 4.0, 100.0, 8.0, 9.0, 9.0, 9.0, 9.0, 9.0],
    [NAN, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
])


def test_loss_units_count_action_tokens_and_rows_with_one():
    assert int(ops.loss_units(M_H, "token_mean")) == 7
    assert int(ops.loss_units(M_H, "seq_mean_token_mean")) == 2  # the all-holes row is no sequence
    assert int(ops.loss_units(M_H, "seq_mean_token_sum")) == 2


def test_aggregation_with_holes_hand_values():
    close(ops.aggregate_loss(PER_TOKEN_H, M_H, "token_mean", 7), 27.0 / 7.0)  # (15 + 12) / 7 = 3.8571429
    close(ops.aggregate_loss(PER_TOKEN_H, M_H, "seq_mean_token_mean", 2), 4.5)  # (15/5 + 12/2) / 2
    close(ops.aggregate_loss(PER_TOKEN_H, M_H, "seq_mean_token_sum", 2, max_len=9), 1.5)  # 27 / 9 / 2


def test_policy_loss_with_holes_hand_example():
    # action tokens at 0, 2, 4 (ratios 1.5, 0.5, 1.1; advantages 1, 1, -1); holes at 1 and 3 hold garbage
    lp = torch.tensor([[math.log(1.5), INF, math.log(0.5), NAN, math.log(1.1), 0.0]], requires_grad=True)
    old = torch.tensor([[0.0, -INF, 0.0, 3.0, 0.0, 0.0]])
    adv = torch.tensor([[1.0, NAN, 1.0, 5.0, -1.0, NAN]])
    m = mask_of("101010")
    loss, stats = ops.policy_loss(lp, old, adv, m, clip_range=0.2)
    # per action token: max(-1.5, -1.2) = -1.2 ; max(-0.5, -0.8) = -0.5 ; max(1.1, 1.1) = 1.1 -> -0.6 / 3
    close(loss, -0.2)
    close(stats["clipfrac"], 1.0 / 3.0)
    close(stats["ratio"], 3.1 / 3.0)
    close(stats["approx_kl"], 0.1089898)  # 0.5 * (0.1644019 + 0.4804530 + 0.0090840) / 3
    loss.backward()
    close(lp.grad, [[0.0, 0.0, -0.5 / 3.0, 0.0, 1.1 / 3.0, 0.0]])  # holes get no gradient (and no NaN)


def test_value_loss_with_holes_hand_example():
    # action tokens at 0, 2, 3; the hole at 1 and the padding hold garbage
    values = torch.tensor([[1.5, NAN, 0.9, 1.5, INF]], requires_grad=True)
    old = torch.tensor([[1.0, 50.0, 1.0, 1.0, 0.0]])
    returns = torch.tensor([[2.0, -INF, 0.0, 0.5, 0.0]])
    m = mask_of("10110")
    loss, stats = ops.value_loss(values, old, returns, m, clip_range_value=0.2)
    # tok0: max(0.25, (1.2-2)^2 = 0.64) = 0.64 (clipped); tok2: 0.81; tok3: max(1.0, 0.49) = 1.0
    close(loss, 0.5 * 2.45 / 3.0)  # 0.4083333
    close(stats["clipfrac"], 1.0 / 3.0)
    close(stats["error"], 2.06 / 3.0)  # (0.25 + 0.81 + 1.0) / 3
    loss.backward()
    close(values.grad, [[0.0, 0.0, 0.3, 1.0 / 3.0, 0.0]])


# --------------------------------------------------------------------------- #
# rewards
# --------------------------------------------------------------------------- #
def test_penalized_rewards_score_on_the_last_action_token():
    kl = torch.tensor([
        [0.1, 0.2, NAN, 0.4, 0.5, 0.6, 0.7],  # actions 0, 1, 4: the last True is 4, not mask.sum()-1 = 2
        [0.2, 0.4, 0.6, 0.8, 1.0, 1.2, 1.4],  # starts with a hole; actions 1, 3: last is 3, not 1
        [0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1],  # all holes
    ])
    m = mask_of("1100100", "0101000", "0000000")
    scores = torch.tensor([1.0, 2.0, 5.0])
    out = ops.penalized_rewards(kl, m, kl_coef=0.5, scores=scores)
    # row 0: -0.5 * [0.1, 0.2, _, _, 0.5] = [-0.05, -0.1, 0, 0, -0.25]; + 1 on position 4 -> 0.75
    # row 1: -0.5 * [_, 0.4, _, 0.8] = [0, -0.2, 0, -0.4]; + 2 on position 3 -> 1.6
    # row 2: no action token: nothing, the score 5 is dropped
    close(out, [
        [-0.05, -0.1, 0.0, 0.0, 0.75, 0.0, 0.0],
        [0.0, -0.2, 0.0, 1.6, 0.0, 0.0, 0.0],
        [0.0] * 7,
    ])


def test_penalized_rewards_dense_on_action_tokens_only():
    kl = torch.tensor([[0.2, 0.4, 0.6, 0.8, NAN]])
    m = mask_of("10110")
    dense = torch.tensor([[1.0, 9.0, 0.5, 0.0, 9.0]])  # the 9s sit on a hole and on padding: dropped
    # kl_coef 0.1: [-0.02, _, -0.06, -0.08, _] ; + dense [1, _, 0.5, 0] ; + score 3 on position 3
    close(ops.penalized_rewards(kl, m, 0.1, scores=torch.tensor([3.0]), dense_scores=dense),
          [[0.98, 0.0, 0.44, 2.92, 0.0]])


# --------------------------------------------------------------------------- #
# GAE
# --------------------------------------------------------------------------- #
GAMMA, LAM = 0.9, 0.5  # gamma * lam = 0.45
M_GAE = mask_of(
    "111001100",  # two turns with a 2-token environment span between them, then padding
    "011010000",  # starts with a hole (the first response token is an environment token)
    "101001000",  # two holes (spans at 1 and at 3-4)
    "000000000",  # all holes: no action token
)
R_GAE = torch.tensor([
    [1.0, 0.0, 0.5, NAN, 7.0, 0.0, 2.0, 99.0, 99.0],
    [5.0, 0.0, 1.0, -3.0, 2.0, 99.0, 99.0, 99.0, 99.0],
    [0.5, 10.0, 0.0, -10.0, -10.0, 1.0, 99.0, 99.0, 99.0],
    [1.0, NAN, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
])
V_GAE = torch.tensor([
    [0.5, 1.0, 0.8, INF, -9.0, 1.2, 1.5, 5.0, 5.0],
    [4.0, 0.5, 0.5, 8.0, 1.0, 5.0, 5.0, 5.0, 5.0],
    [1.0, 3.0, 2.0, 3.0, 3.0, 0.5, 5.0, 5.0, 5.0],
    [INF, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
])


def test_gae_skips_holes_hand_values():
    adv, ret = ops.gae(R_GAE, V_GAE, M_GAE, GAMMA, LAM)
    # row 0, action tokens 0 1 2 | 5 6:
    #   k=6 (last): delta = 2 + 0            - 1.5 = 0.5   ; A = 0.5
    #   k=5:        delta = 0 + 0.9*1.5(V6)  - 1.2 = 0.15  ; A = 0.15  + 0.45*0.5     = 0.375
    #   k=2:        delta = 0.5 + 0.9*1.2(V5) - 0.8 = 0.78 ; A = 0.78  + 0.45*0.375   = 0.94875
    #   k=1:        delta = 0 + 0.9*0.8      - 1.0 = -0.28 ; A = -0.28 + 0.45*0.94875 = 0.1469375
    #   k=0:        delta = 1 + 0.9*1.0      - 0.5 = 1.4   ; A = 1.4   + 0.45*0.1469375 = 1.466121875
    # row 1, action tokens 1 2 | 4:
    #   k=4: delta = 2 - 1.0 = 1.0 ; A = 1.0
    #   k=2: delta = 1 + 0.9*1.0(V4) - 0.5 = 1.4 ; A = 1.4 + 0.45*1.0 = 1.85
    #   k=1: delta = 0 + 0.9*0.5 - 0.5 = -0.05   ; A = -0.05 + 0.45*1.85 = 0.7825
    # row 2, action tokens 0 | 2 | 5:
    #   k=5: delta = 1 - 0.5 = 0.5 ; A = 0.5
    #   k=2: delta = 0 + 0.9*0.5(V5) - 2.0 = -1.55 ; A = -1.55 + 0.45*0.5 = -1.325
    #   k=0: delta = 0.5 + 0.9*2.0(V2) - 1.0 = 1.3 ; A = 1.3 + 0.45*(-1.325) = 0.70375
    # row 3: no action token -> zeros
    close(adv, [
        [1.466121875, 0.1469375, 0.94875, 0.0, 0.0, 0.375, 0.5, 0.0, 0.0],
        [0.0, 0.7825, 1.85, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0],
        [0.70375, 0.0, -1.325, 0.0, 0.0, 0.5, 0.0, 0.0, 0.0],
        [0.0] * 9,
    ])
    # returns = A + V on action tokens, 0 at holes and padding
    close(ret, [
        [1.966121875, 1.1469375, 1.74875, 0.0, 0.0, 1.575, 2.0, 0.0, 0.0],
        [0.0, 1.2825, 2.35, 0.0, 2.0, 0.0, 0.0, 0.0, 0.0],
        [1.70375, 0.0, 0.675, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0],
        [0.0] * 9,
    ])
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()


def test_gae_a_hole_is_not_the_end_of_the_episode():
    # the same row 0 with the hole read as an episode end would give A2 = 0.5 - 0.8 = -0.3
    adv, _ = ops.gae(R_GAE[:1], V_GAE[:1], M_GAE[:1], GAMMA, LAM)
    assert abs(float(adv[0, 2]) - 0.94875) < 1e-6 and abs(float(adv[0, 2]) + 0.3) > 0.1


def test_gae_with_holes_equals_gae_on_the_compacted_rows():
    """Removing the holes (action tokens moved left, right-padded), running GAE and putting the results
    back where they came from gives the same numbers as GAE on the row with holes."""
    g = torch.Generator().manual_seed(11)
    B, T = 12, 10
    mask = torch.rand(B, T, generator=g) < 0.6
    mask[0] = False  # all holes
    mask[1, 0] = False  # starts with a hole
    rewards = torch.randn(B, T, generator=g, dtype=torch.float64)
    values = torch.randn(B, T, generator=g, dtype=torch.float64)
    rewards[~mask], values[~mask] = NAN, INF  # holes carry garbage
    for gamma, lam in [(0.9, 0.5), (1.0, 0.95), (0.99, 1.0), (0.5, 0.0)]:
        adv, ret = ops.gae(rewards, values, mask, gamma, lam)
        compact_r = torch.full((B, T), 123.0, dtype=torch.float64)  # padding garbage
        compact_v = torch.full((B, T), -123.0, dtype=torch.float64)
        compact_m = torch.zeros(B, T, dtype=torch.bool)
        for b in range(B):
            idx = mask[b].nonzero().flatten()
            n = len(idx)
            compact_r[b, :n], compact_v[b, :n], compact_m[b, :n] = rewards[b, idx], values[b, idx], True
        c_adv, c_ret = ops.gae(compact_r, compact_v, compact_m, gamma, lam)
        want_adv, want_ret = torch.zeros(B, T, dtype=torch.float64), torch.zeros(B, T, dtype=torch.float64)
        for b in range(B):
            idx = mask[b].nonzero().flatten()
            want_adv[b, idx], want_ret[b, idx] = c_adv[b, : len(idx)], c_ret[b, : len(idx)]
        assert torch.equal(adv, want_adv) and torch.equal(ret, want_ret)
        assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()


def test_gae_with_holes_matches_a_naive_loop():
    """cleanrl-style check: the vectorised GAE against the textbook sum over each row's action tokens."""
    g = torch.Generator().manual_seed(12)
    B, T = 9, 11
    mask = torch.rand(B, T, generator=g) < 0.5
    rewards = torch.randn(B, T, generator=g, dtype=torch.float64)
    values = torch.randn(B, T, generator=g, dtype=torch.float64)
    for gamma, lam in [(0.9, 0.5), (1.0, 0.95), (0.5, 0.0)]:
        adv, ret = ops.gae(rewards, values, mask, gamma, lam)
        want = torch.zeros(B, T, dtype=torch.float64)
        for b in range(B):
            ks = mask[b].nonzero().flatten().tolist()  # action tokens in order
            for i, k in enumerate(ks):
                a = 0.0
                for j in range(i, len(ks)):  # A_k = sum_j (gamma*lam)^(j-i) delta_{ks[j]}
                    v_next = values[b, ks[j + 1]].item() if j + 1 < len(ks) else 0.0
                    delta = rewards[b, ks[j]].item() + gamma * v_next - values[b, ks[j]].item()
                    a += (gamma * lam) ** (j - i) * delta
                want[b, k] = a
        torch.testing.assert_close(adv, want)
        torch.testing.assert_close(ret, torch.where(mask, want + values, torch.zeros((), dtype=torch.float64)))


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.long, torch.float32])
def test_gae_accepts_01_masks_with_holes(mask_dtype):
    adv, _ = ops.gae(R_GAE, V_GAE, M_GAE.to(mask_dtype), GAMMA, LAM)
    close(adv[1], [0.0, 0.7825, 1.85, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0])
