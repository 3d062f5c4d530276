"""Per-token rewards, GAE and critic-free group advantages."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from .common import bool_mask, float_dtype


def penalized_rewards(
    kl: Tensor,
    mask: Tensor,
    kl_coef: float,
    scores: Tensor | None = None,
    dense_scores: Tensor | None = None,
) -> Tensor:
    """Per-token rewards with a KL penalty (Ziegler et al. 2019, eq. 2).

    ``R(x, y) = r(x, y) - beta * KL``; as in Ziegler et al. / trlx / TRL the
    KL is applied per token and the sequence-level score only on the final
    token, so GAE propagates it backwards through the response.

    Holes: only action tokens (``mask`` True) get a reward. The score goes on
    the LAST action token of the row, i.e. the last True, wherever it is (not
    on position ``mask.sum() - 1``, which would be a hole or an earlier turn
    when the row has holes). KL and dense rewards at holes are dropped.

    Args:
        kl: ``(B, T)`` per-token KL estimate (see :func:`kl_estimate`).
        mask: ``(B, T)`` action mask (True on tokens the policy sampled; may
            have holes).
        kl_coef: beta.
        scores: ``(B,)`` scalar reward per sequence, added on the last action
            token of each row; rows without action tokens get nothing.
        dense_scores: ``(B, T)`` per-token rewards by position, added on
            action tokens only.

    Returns:
        ``(B, T)`` rewards, zeros at padding and holes, dtype of ``kl``.
    """
    m = bool_mask(mask, kl)
    dtype = float_dtype(kl)
    zero = torch.zeros((), dtype=dtype, device=kl.device)
    rewards = torch.where(m, -kl_coef * kl.to(dtype), zero)  # (B, T)
    if scores is not None:
        T = kl.shape[-1]
        pos = torch.arange(T, device=kl.device)  # (T,)
        # index of the last True per row (a max over positions, not the count
        # of Trues, so holes do not move it); -1 for rows with no action token,
        # which matches no position.
        last = torch.where(m, pos, torch.full_like(pos, -1)).amax(dim=-1)  # (B,)
        is_last = pos == last.unsqueeze(-1)  # (B, T)
        rewards = rewards + torch.where(is_last, scores.to(dtype).unsqueeze(-1), zero)
    if dense_scores is not None:
        rewards = rewards + torch.where(m, dense_scores.to(dtype), zero)
    return rewards


def _compacted_positions(m: Tensor) -> Tensor:
    """Where each token of a row goes when the action tokens move left, in order.

    ``(B, T)`` bool -> ``(B, T)`` int64, a permutation of ``0..T-1`` per row:
    the k-th action token goes to ``k``, the other tokens (holes, padding)
    follow in their order. On a right-padded mask it is ``arange(T)`` on every
    row, so compacting and restoring with it copies values unchanged (the
    results on masks without holes are the same bits as before holes existed).
    """
    n_action = m.sum(dim=-1, keepdim=True)  # (B, 1)
    return torch.where(m, m.cumsum(dim=-1) - 1, n_action + (~m).cumsum(dim=-1) - 1)  # (B, T)


def gae(
    rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    gamma: float,
    lam: float,
) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016, eq. 16).

    ``delta_t = r_t + gamma * V_{t+1} - V_t``,
    ``A_t = delta_t + gamma * lam * A_{t+1}``.

    Each response is one episode that terminates at its last action token, so
    the bootstrap value after it is 0 (no value is read from padding).

    Holes (tokens in the context that the policy did not sample, e.g. a tool
    result between two turns) are skipped, not treated as the end of the
    episode: the chain runs over the ACTION tokens of the row in order. For an
    action token ``k`` whose next action token in the row is ``k'``:
    ``delta_k = r_k + gamma * V_{k'} - V_k`` and
    ``A_k = delta_k + gamma * lam * A_{k'}``; the last action token of the row
    bootstraps with 0. So an environment span costs no discount step, and a
    reward or value placed at a hole is ignored (the rewards of an environment
    span belong on an action token, e.g. the last one before it). Advantages
    and returns at holes and padding are 0. Implementation: the action tokens
    are moved left (stable order), the right-padded recursion runs, and the
    results are moved back; on a mask without holes the move is the identity.

    Args:
        rewards: ``(B, T)`` per-token rewards (e.g. :func:`penalized_rewards`).
        values: ``(B, T)`` value estimates V(s_t).
        mask: ``(B, T)`` action mask (may have holes).
        gamma: discount.
        lam: GAE lambda.

    Returns:
        ``(advantages, returns)``, both ``(B, T)``, zeros at holes and padding;
        ``returns = advantages + values`` (the lambda-return targets).
    """
    m = bool_mask(mask, values)
    dtype = torch.promote_types(float_dtype(values), float_dtype(rewards))
    zero = torch.zeros((), dtype=dtype, device=values.device)
    r = torch.where(m, rewards.to(dtype), zero)  # (B, T)
    v = torch.where(m, values.to(dtype), zero)  # (B, T)
    B, T = v.shape
    if T == 0:
        return v.clone(), v.clone()
    dest = _compacted_positions(m)  # (B, T)
    # compacted rows are right-padded: action tokens first, zeros after them
    r_c = torch.empty_like(r).scatter_(1, dest, r)  # (B, T)
    v_c = torch.empty_like(v).scatter_(1, dest, v)  # (B, T)
    m_c = torch.arange(T, device=m.device) < m.sum(dim=-1, keepdim=True)  # (B, T)
    advantages = _right_padded_gae(r_c, v_c, m_c, gamma, lam).gather(1, dest)  # (B, T)
    returns = torch.where(m, advantages + v, zero)  # (B, T)
    return advantages, returns


def _right_padded_gae(r: Tensor, v: Tensor, m: Tensor, gamma: float, lam: float) -> Tensor:
    """The GAE recursion on right-padded rows whose rewards/values are 0 at padding: ``(B, T)`` -> ``(B, T)``.

    Zeroing values/advantages at padded positions is what ends the recursion,
    with no per-row bookkeeping.
    """
    B, T = v.shape
    next_value = torch.cat([v[:, 1:], v.new_zeros(B, 1)], dim=1)  # (B, T), V_{t+1}; 0 past the end
    deltas = r + gamma * next_value - v  # (B, T)
    mf = m.to(v.dtype)  # (B, T)
    adv_t = v.new_zeros(B)  # (B,) A_{t+1}
    advs: list[Tensor] = [adv_t] * T
    for t in reversed(range(T)):
        # multiplying by the mask zeroes A at padding, so the first real step
        # from the end starts its recursion from A_{t+1} = 0
        adv_t = (deltas[:, t] + gamma * lam * adv_t) * mf[:, t]
        advs[t] = adv_t
    return torch.stack(advs, dim=1)  # (B, T)


class _GroupStats(NamedTuple):
    """Per-group sums of one batch of scores, by group id (``P`` = max id + 1)."""

    count: Tensor  # (P,) samples per id
    total: Tensor  # (P,) sum of scores per id
    centred: Tensor  # (N,) score minus its group's mean
    zero_std: Tensor  # (N,) bool: the sample's group has all-equal scores
    group_std: Tensor  # (P,) unbiased std per id; 0 for a group of one or an unused id


def _group_stats(s: Tensor, ids: Tensor) -> _GroupStats:
    """Statistics gathered per id with ``index_add`` / ``scatter_reduce`` (never by reshaping)."""
    P = int(ids.max()) + 1 if len(ids) else 0
    zeros = s.new_zeros(P)
    count = zeros.index_add(0, ids, torch.ones_like(s))  # (P,)
    total = zeros.index_add(0, ids, s)  # (P,)
    mean = total / count.clamp(min=1)  # (P,)
    hi = torch.full_like(zeros, -math.inf).scatter_reduce(0, ids, s, "amax")  # (P,)
    lo = torch.full_like(zeros, math.inf).scatter_reduce(0, ids, s, "amin")  # (P,)
    zero_std = (hi == lo)[ids]  # (N,)
    centred = s - mean[ids]  # (N,)
    sq = zeros.index_add(0, ids, centred.square())  # (P,)
    group_std = torch.where(count > 1, (sq / (count - 1).clamp(min=1)).sqrt(), zeros)  # (P,)
    return _GroupStats(count, total, centred, zero_std, group_std)


def _grpo(s: Tensor, ids: Tensor, st: _GroupStats, scale: str, std_floor: float) -> Tensor:
    """``(r - mean_g) / max(std, floor)`` with the std chosen by ``scale``."""
    if scale == "group":
        return st.centred / st.group_std[ids].clamp(min=std_floor)
    if scale == "batch":
        batch_std = float(s.std()) if len(s) > 1 else 0.0  # unbiased
        return st.centred / max(batch_std, std_floor)
    if scale == "none":
        return st.centred
    raise ValueError(f"unknown group scale {scale!r}; expected 'group', 'batch' or 'none'")


def _rloo(s: Tensor, ids: Tensor, st: _GroupStats) -> Tensor:
    """``r_i - mean(r_j, j != i)``; 0 for a group of one (no other sample to compare with)."""
    others = (st.count - 1)[ids]  # (N,)
    return torch.where(others > 0, s - (st.total[ids] - s) / others.clamp(min=1), s.new_zeros(()))


def group_advantages(
    scores: Tensor,
    group_ids: Tensor,
    estimator: str,
    scale: str = "group",
    std_floor: float = 1e-4,
    scorable: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Critic-free sequence advantages from each group's scores, by group id.

    ``N`` is the number of samples of the WHOLE global batch (every rank's), in
    any order: statistics are gathered per id (``index_add``), never by
    reshaping, so a group's members may sit anywhere (on several ranks, in
    different chunks) and groups need not be contiguous.

    * ``grpo`` (Shao et al. 2024, DeepSeekMath): ``(r - mean_g) / max(std, floor)``
      with ``std`` the group's unbiased sample std (``scale="group"``, as TRL and
      veRL), the whole batch's unbiased std (``"batch"``) or no division
      (``"none"``: Dr. GRPO, Liu et al. 2025).
    * ``rloo`` (Ahmadian et al. 2024): ``r_i - mean(r_j, j != i)`` over the group
      (= ``k / (k - 1) * (r_i - mean_g)``).

    A group whose scores are all equal gets advantage exactly 0 (no NaN from a
    zero std; no rounding residue of ``r - mean``), and so does a group of one
    (it has no baseline: veRL's "mean 0, std 1" rule would train on the raw
    score there). The arithmetic is float64.

    Args:
        scores: ``(N,)`` one score per sample (outcome reward).
        group_ids: ``(N,)`` int group id per sample (ids need not be contiguous
            in the batch; the largest id bounds the work).
        estimator: ``"grpo"`` or ``"rloo"``.
        scale: ``grpo`` only: ``"group"``, ``"batch"`` or ``"none"``.
        std_floor: ``grpo``: the divisor is at least this.
        scorable: ``(N,)`` bool, optional: False for a sample without a reward
            (every reward function returned None; TRL #5902). Such a sample is
            left out of its group's statistics (mean, std, count, the RLOO
            baseline, the ``"batch"`` std) and gets advantage exactly 0; its
            score is never read. A group with no scorable member gets 0 and
            counts as zero-std. ``None``: every sample is scorable (the same
            bits as without the argument).

    Returns:
        ``(advantages (N,) float64, zero_std (N,) bool: the sample's group has
        all-equal scores, group_std (P,) float64: each group id's unbiased std,
        0 for a group of one; P = max id + 1, ids without samples give 0)``.
    """
    # (Over 60 lines only by its docstring, which defines each estimator's formula; the code is ~20 lines.)
    s = scores.detach().to(torch.float64).reshape(-1)  # (N,)
    ids = group_ids.to(torch.long).reshape(-1)  # (N,)
    if s.shape != ids.shape:
        raise ValueError(f"scores {tuple(scores.shape)} and group_ids {tuple(group_ids.shape)} differ")
    if scorable is not None:
        return _scorable_only(s, ids, scorable, estimator, scale, std_floor)
    st = _group_stats(s, ids)
    if estimator == "grpo":
        adv = _grpo(s, ids, st, scale, std_floor)
    elif estimator == "rloo":
        adv = _rloo(s, ids, st)
    else:
        raise ValueError(f"unknown critic-free estimator {estimator!r}; expected 'grpo' or 'rloo'")
    adv = torch.where(st.zero_std, s.new_zeros(()), adv)
    return adv, st.zero_std, st.group_std


def _scorable_only(s: Tensor, ids: Tensor, scorable: Tensor, estimator: str, scale: str,
                   std_floor: float) -> tuple[Tensor, Tensor, Tensor]:
    """``group_advantages`` over the scorable samples only; the others get advantage 0, and the zero-std
    flag of their group (True for a group with no scorable member)."""
    keep = scorable.to(torch.bool).reshape(-1)  # (N,)
    if keep.shape != s.shape:
        raise ValueError(f"scorable {tuple(scorable.shape)} and scores {tuple(s.shape)} differ")
    P = int(ids.max()) + 1 if len(ids) else 0
    adv_k, zero_k, std_k = group_advantages(s[keep], ids[keep], estimator, scale, std_floor)  # (K,) (K,) (P',)
    adv = s.new_zeros(s.shape)  # (N,)
    adv[keep] = adv_k
    group_zero = torch.ones(P, dtype=torch.bool, device=s.device)  # (P,) no scorable member: no signal
    group_zero[ids[keep]] = zero_k
    group_std = s.new_zeros(P)  # (P,)
    group_std[: len(std_k)] = std_k
    return adv, group_zero[ids], group_std
def group_spread(scores: Tensor, group_ids: Tensor) -> Tensor:
    """Whether each group id's scores are not all equal: ``(P,)`` bool, ``P = max id + 1``.

    DAPO's dynamic-sampling test (Yu et al. 2025, section 3.2: ``0 < |{o_i correct}| < G``), generalised
    to any score: a group whose members all scored the same has advantage exactly 0 under
    :func:`group_advantages` and teaches nothing. False for a group of one and for an id without
    samples. Gathered per id (``scatter_reduce``), never by reshaping, like the group statistics.

    Args:
        scores: ``(N,)`` one score per sample, of the whole global batch.
        group_ids: ``(N,)`` int group id per sample.
    """
    s = scores.detach().to(torch.float64).reshape(-1)  # (N,)
    ids = group_ids.to(torch.long).reshape(-1)  # (N,)
    if s.shape != ids.shape:
        raise ValueError(f"scores {tuple(scores.shape)} and group_ids {tuple(group_ids.shape)} differ")
    P = int(ids.max()) + 1 if len(ids) else 0
    hi = torch.full((P,), -math.inf, dtype=s.dtype).scatter_reduce(0, ids, s, "amax")  # (P,)
    lo = torch.full((P,), math.inf, dtype=s.dtype).scatter_reduce(0, ids, s, "amin")  # (P,)
    return hi > lo  # an unused id: -inf > inf is False


def overlong_penalty(lengths: Tensor, max_len: int, buffer: int, penalty: float) -> Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv 2503.14476, section 3.4), scaled by ``penalty``.

    ``0`` for ``L <= max_len - buffer``, then linear down to ``-penalty`` at ``L = max_len``:

        R(L) = -penalty * clamp(L - (max_len - buffer), 0, buffer) / buffer

    (DAPO: ``penalty`` 1, ``buffer`` = L_cache; TRL's ``get_soft_overlong_punishment``, veRL's
    ``overlong_buffer_cfg``, OpenRLHF's ``overlong_buffer_len`` / ``overlong_penalty_factor``.) A
    length beyond ``max_len`` gets ``-penalty`` too.

    Args:
        lengths: ``(B,)`` response lengths in tokens.
        max_len: the length budget (``generation.max_new_tokens``).
        buffer: the soft zone's length, ``1 <= buffer <= max_len``.
        penalty: the penalty at ``max_len`` (``>= 0``).

    Returns:
        ``(B,)`` float64 penalties (<= 0), to add to the scores.
    """
    if not 1 <= buffer <= max_len:
        raise ValueError(f"overlong buffer {buffer} must be in [1, max_len={max_len}]")
    excess = (lengths.to(torch.float64) - (max_len - buffer)).clamp(min=0, max=buffer)  # (B,)
    return -penalty * excess / buffer
