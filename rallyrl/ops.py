"""Pure tensor math for PPO on language models.

Nothing in this module talks to other processes, reads a config object or
does I/O. Where a statistic has to be global across processes, the function
takes an optional ``reduce`` callable that sums a 1-D float tensor over all
processes (the collectives module supplies one; ``None`` means "this process
only"). Each statistics computation calls ``reduce`` exactly once, on one
stacked vector, so a multi-process run pays one collective per statistic
(made by the caller, in ``rallyrl.dist``).

Shape legend used in docstrings and ``# (B, T)`` comments:

* ``B`` -- local batch size (rows on this process)
* ``G`` -- global batch size (rows on all processes together)
* ``T`` -- response length (padded)
* ``V`` -- vocabulary size

Mask convention: ``mask`` is a bool (or 0/1) tensor, True for real tokens.
Responses are right-padded, so each row of a ``(B, T)`` mask is a contiguous
prefix of Trues, possibly empty. Values at padded positions are never read,
so they may hold garbage (even ``inf``/``nan``) without leaking into results.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import Tensor

__all__ = [
    "ReduceFn",
    "logprobs_from_logits",
    "entropy_from_logits",
    "kl_estimate",
    "masked_sum",
    "masked_mean",
    "masked_moments",
    "masked_whiten",
    "penalized_rewards",
    "gae",
    "group_advantages",
    "loss_units",
    "aggregate_loss",
    "policy_loss",
    "value_loss",
    "FixedKLController",
    "AdaptiveKLController",
    "RunningMoments",
]

ReduceFn = Callable[[Tensor], Tensor]
"""Sums a 1-D float tensor over all processes and returns the sum (same shape)."""

_LOW_PRECISION = (torch.float16, torch.bfloat16)
KL_ESTIMATORS = ("k1", "k2", "k3")
LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")


# --------------------------------------------------------------------------- #
# helpers
# --------------------------------------------------------------------------- #
def _bool_mask(mask: Tensor, like: Tensor) -> Tensor:
    """Return ``mask`` as a bool tensor expanded to ``like.shape``."""
    m = mask if mask.dtype == torch.bool else mask != 0
    return m.expand(like.shape)


def _float_dtype(x: Tensor) -> torch.dtype:
    """``x.dtype`` if floating, else float32 (so means of int/bool tensors work)."""
    return x.dtype if x.is_floating_point() else torch.float32


def _rowwise_fp32(logits: Tensor, fn: Callable[[Tensor], Tensor]) -> Tensor:
    """Apply ``fn`` over the last dim, upcasting half-precision logits to float32.

    For fp16/bf16 logits a whole-batch ``.float()`` copy would double the
    largest activation of the step, (B, T, V). Upcasting one row at a time
    keeps the extra memory at (T, V) while still doing the exp/log in float32
    (the same trick as TRL's ``selective_log_softmax``). Output is float32 for
    half inputs: bf16 log-probs are too coarse for PPO ratios exp(lp - old_lp).
    """
    if logits.dtype not in _LOW_PRECISION:
        return fn(logits)
    if logits.dim() < 3 or logits.shape[0] == 0:
        return fn(logits.float())
    return torch.stack([fn(row.float()) for row in logits])  # (B, T)


# --------------------------------------------------------------------------- #
# log-probs, entropy, KL
# --------------------------------------------------------------------------- #
def _label_logprob(logits: Tensor, labels: Tensor) -> Tensor:
    """``x[y] - logsumexp(x)`` over the last dim: (..., V), (...) -> (...)."""
    picked = torch.take_along_dim(logits, labels.unsqueeze(-1), dim=-1).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def logprobs_from_logits(logits: Tensor, labels: Tensor) -> Tensor:
    """Log-probability of ``labels`` under the categorical given by ``logits``.

    Args:
        logits: ``(B, T, V)`` unnormalised scores (any leading dims work).
        labels: ``(B, T)`` int64 token ids; every entry must be a valid index
            in ``[0, V)`` (put e.g. the pad id at padded positions, not -100).

    Returns:
        ``(B, T)`` ``log p(label)``; dtype of ``logits`` for float32/float64,
        float32 for fp16/bf16 logits.

    ``log_softmax(x)[y] = x[y] - logsumexp(x)``: picking one logit and
    subtracting the logsumexp avoids keeping a full (B, T, V) log-softmax
    output alive (and saved for backward) only to read one entry per token.
    """
    if logits.dtype not in _LOW_PRECISION:
        return _label_logprob(logits, labels)  # (B, T)
    if logits.dim() < 3 or logits.shape[0] == 0:
        return _label_logprob(logits.float(), labels)
    # half precision: upcast one (T, V) row at a time, see _rowwise_fp32
    rows = [_label_logprob(row_logits.float(), row_labels) for row_logits, row_labels in zip(logits, labels)]
    return torch.stack(rows)  # (B, T)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the categorical given by ``logits``.

    Args:
        logits: ``(B, T, V)`` (any leading dims work).

    Returns:
        ``(B, T)`` entropy in nats; float32 for fp16/bf16 logits.

    Uses ``H = logsumexp(x) - sum_v p_v x_v``; terms with ``p_v == 0`` are
    dropped explicitly so ``-inf`` logits (masked vocab) give 0, not NaN.
    """

    def _fn(lg: Tensor) -> Tensor:
        lse = torch.logsumexp(lg, dim=-1, keepdim=True)  # (B, T, 1)
        p = torch.exp(lg - lse)  # (B, T, V)
        p_x = torch.where(p > 0, p * lg, torch.zeros((), dtype=lg.dtype, device=lg.device))
        return lse.squeeze(-1) - p_x.sum(dim=-1)  # (B, T)

    return _rowwise_fp32(logits, _fn)


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k1") -> Tensor:
    """Per-token Monte-Carlo estimate of ``KL(pi || ref)`` at tokens sampled from pi.

    Estimators from John Schulman, "Approximating KL Divergence" (2020), with
    ``log r = ref_lp - lp`` (r = ref/pi, the ratio the blog uses):

    * ``k1 = -log r = lp - ref_lp`` -- unbiased, high variance, can be < 0.
    * ``k2 = 0.5 * (log r)^2`` -- biased, low variance, always >= 0.
    * ``k3 = (r - 1) - log r`` -- unbiased, low variance, always >= 0.
      Computed as ``expm1(log r) - log r`` so tiny differences don't cancel.

    Args:
        logprobs: ``(B, T)`` log pi(token).
        ref_logprobs: ``(B, T)`` log ref(token).
        estimator: one of ``"k1"``, ``"k2"``, ``"k3"``.

    Returns:
        ``(B, T)`` per-token estimate (mask it yourself).
    """
    if estimator == "k1":
        return logprobs - ref_logprobs
    log_r = ref_logprobs - logprobs  # (B, T)
    if estimator == "k2":
        return 0.5 * log_r.square()
    if estimator == "k3":
        return torch.expm1(log_r) - log_r
    raise ValueError(
        f"unknown KL estimator {estimator!r}; expected one of {', '.join(map(repr, KL_ESTIMATORS))}"
    )


# --------------------------------------------------------------------------- #
# masked reductions
# --------------------------------------------------------------------------- #
def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``x`` over positions where ``mask`` is True.

    Args:
        x: any shape, e.g. ``(B, T)``.
        mask: same shape as ``x`` or expandable to it; bool or 0/1.
        dim: reduce only this dim (e.g. ``dim=-1`` gives ``(B,)``); None = all.

    ``torch.where`` rather than ``x * mask`` so garbage (inf/nan) at padded
    positions cannot turn into NaN via ``inf * 0``.
    """
    m = _bool_mask(mask, x)
    kept = torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device))
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over masked positions; an empty mask (or empty row) gives 0.

    Args:
        x: any shape, e.g. ``(B, T)``.
        mask: same shape as ``x`` or expandable to it.
        dim: as in :func:`masked_sum`.
    """
    m = _bool_mask(mask, x)
    dtype = _float_dtype(x)
    total = masked_sum(x.to(dtype), m, dim)
    count = m.sum() if dim is None else m.sum(dim=dim)
    return total / count.clamp(min=1).to(dtype)


def _local_moment_sums(x: Tensor, mask: Tensor) -> Tensor:
    """``[sum, sum_sq, count]`` of masked elements as a float64 ``(3,)`` vector."""
    m = _bool_mask(mask, x)
    x64 = torch.where(m, x.double(), torch.zeros((), dtype=torch.float64, device=x.device))
    return torch.stack([x64.sum(), x64.square().sum(), m.sum().double()])  # (3,)


def _moments_from_sums(sums: Tensor, unbiased: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(mean, var, count) in float64 from a ``[sum, sum_sq, count]`` vector."""
    total, total_sq, count = sums.unbind(0)
    safe = count.clamp(min=1)
    mean = total / safe
    # E[x^2] - E[x]^2 in float64: a single summed vector is what lets one
    # cross-process sum give global moments; float64 keeps the cancellation harmless
    # for reward/advantage magnitudes. Clamp guards tiny negative round-off.
    var = (total_sq / safe - mean.square()).clamp(min=0)
    if unbiased:
        bessel = torch.where(count > 1, count / (count - 1).clamp(min=1), torch.ones_like(count))
        var = var * bessel
    return mean, var, count


def masked_moments(
    x: Tensor,
    mask: Tensor,
    reduce: ReduceFn | None = None,
    unbiased: bool = True,
) -> tuple[Tensor, Tensor, Tensor]:
    """Mean, variance and count of all masked elements of ``x``.

    Args:
        x: e.g. ``(B, T)``.
        mask: same shape as ``x`` or expandable to it.
        reduce: sums the local float64 vector ``[sum, sum_sq, count]`` over
            processes (called exactly once); None = local statistics.
        unbiased: apply Bessel's correction ``count / (count - 1)`` when
            ``count > 1``.

    Returns:
        0-dim tensors ``(mean, var, count)``. ``mean``/``var`` have ``x``'s
        float dtype (float32 for non-float ``x``); ``count`` is float64 so it
        stays exact for large global token counts. Empty mask -> (0, 0, 0).
    """
    sums = _local_moment_sums(x, mask)  # (3,)
    if reduce is not None:
        sums = reduce(sums)
    mean, var, count = _moments_from_sums(sums, unbiased)
    dtype = _float_dtype(x)
    return mean.to(dtype), var.to(dtype), count


def masked_whiten(
    x: Tensor,
    mask: Tensor,
    shift_mean: bool = True,
    reduce: ReduceFn | None = None,
    eps: float = 1e-8,
) -> Tensor:
    """Normalise masked elements of ``x`` to zero mean / unit (unbiased) variance.

    Args:
        x: ``(B, T)``.
        mask: ``(B, T)``.
        shift_mean: if False, add the mean back after scaling, i.e. only the
            scale changes (trlx / TRL behaviour when whitening rewards, so
            their sign/offset carries information).
        reduce: as in :func:`masked_moments` (global statistics).
        eps: added to the variance before the square root.

    Returns:
        ``(B, T)`` in ``x.dtype``; zeros where ``mask`` is False.
    """
    sums = _local_moment_sums(x, mask)  # (3,)
    if reduce is not None:
        sums = reduce(sums)
    mean, var, _ = _moments_from_sums(sums, unbiased=True)
    whitened = (x.double() - mean) * torch.rsqrt(var + eps)  # (B, T) float64
    if not shift_mean:
        whitened = whitened + mean
    m = _bool_mask(mask, x)
    out = torch.where(m, whitened, torch.zeros((), dtype=torch.float64, device=x.device))
    return out.to(_float_dtype(x))


# --------------------------------------------------------------------------- #
# rewards and advantages
# --------------------------------------------------------------------------- #
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

    Args:
        kl: ``(B, T)`` per-token KL estimate (see :func:`kl_estimate`).
        mask: ``(B, T)`` right-padded response mask.
        kl_coef: beta.
        scores: ``(B,)`` scalar reward per sequence, added on the LAST real
            token of each row; rows without real tokens get nothing.
        dense_scores: ``(B, T)`` per-token rewards, added on real tokens.

    Returns:
        ``(B, T)`` rewards, zeros on padding, dtype of ``kl``.
    """
    m = _bool_mask(mask, kl)
    dtype = _float_dtype(kl)
    zero = torch.zeros((), dtype=dtype, device=kl.device)
    rewards = torch.where(m, -kl_coef * kl.to(dtype), zero)  # (B, T)
    if scores is not None:
        T = kl.shape[-1]
        pos = torch.arange(T, device=kl.device)  # (T,)
        # index of the last True per row (also right for non-prefix masks);
        # -1 for empty rows, which matches no position.
        last = torch.where(m, pos, torch.full_like(pos, -1)).amax(dim=-1)  # (B,)
        is_last = pos == last.unsqueeze(-1)  # (B, T)
        rewards = rewards + torch.where(is_last, scores.to(dtype).unsqueeze(-1), zero)
    if dense_scores is not None:
        rewards = rewards + torch.where(m, dense_scores.to(dtype), zero)
    return rewards


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

    Each response is one episode that terminates at its last real token, so
    the bootstrap value after it is 0 (no value is read from padding). This
    relies on right padding: zeroing values/advantages at padded positions is
    what ends the recursion, with no per-row bookkeeping.

    Args:
        rewards: ``(B, T)`` per-token rewards (e.g. :func:`penalized_rewards`).
        values: ``(B, T)`` value estimates V(s_t).
        mask: ``(B, T)`` right-padded response mask.
        gamma: discount.
        lam: GAE lambda.

    Returns:
        ``(advantages, returns)``, both ``(B, T)``, zeros on padding;
        ``returns = advantages + values`` (the lambda-return targets).
    """
    m = _bool_mask(mask, values)
    dtype = torch.promote_types(_float_dtype(values), _float_dtype(rewards))
    zero = torch.zeros((), dtype=dtype, device=values.device)
    r = torch.where(m, rewards.to(dtype), zero)  # (B, T)
    v = torch.where(m, values.to(dtype), zero)  # (B, T)
    B, T = v.shape
    if T == 0:
        return v.clone(), v.clone()
    next_value = torch.cat([v[:, 1:], v.new_zeros(B, 1)], dim=1)  # (B, T), V_{t+1}; 0 past the end
    deltas = r + gamma * next_value - v  # (B, T)
    mf = m.to(dtype)  # (B, T)
    adv_t = v.new_zeros(B)  # (B,) A_{t+1}
    advs: list[Tensor] = [adv_t] * T
    for t in reversed(range(T)):
        # multiplying by the mask zeroes A at padding, so the first real step
        # from the end starts its recursion from A_{t+1} = 0
        adv_t = (deltas[:, t] + gamma * lam * adv_t) * mf[:, t]
        advs[t] = adv_t
    advantages = torch.stack(advs, dim=1)  # (B, T)
    returns = torch.where(m, advantages + v, zero)  # (B, T)
    return advantages, returns


def group_advantages(
    scores: Tensor,
    group_ids: Tensor,
    estimator: str,
    scale: str = "group",
    std_floor: float = 1e-4,
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

    Returns:
        ``(advantages (N,) float64, zero_std (N,) bool: the sample's group has
        all-equal scores, group_std (P,) float64: each group id's unbiased std,
        0 for a group of one; P = max id + 1, ids without samples give 0)``.
    """
    s = scores.detach().to(torch.float64).reshape(-1)  # (N,)
    ids = group_ids.to(torch.long).reshape(-1)  # (N,)
    if s.shape != ids.shape:
        raise ValueError(f"scores {tuple(scores.shape)} and group_ids {tuple(group_ids.shape)} differ")
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
    if estimator == "grpo":
        if scale == "group":
            adv = centred / group_std[ids].clamp(min=std_floor)
        elif scale == "batch":
            batch_std = float(s.std()) if len(s) > 1 else 0.0  # unbiased
            adv = centred / max(batch_std, std_floor)
        elif scale == "none":
            adv = centred
        else:
            raise ValueError(f"unknown group scale {scale!r}; expected 'group', 'batch' or 'none'")
    elif estimator == "rloo":
        others = (count - 1)[ids]  # (N,)
        adv = torch.where(others > 0, s - (total[ids] - s) / others.clamp(min=1), s.new_zeros(()))
    else:
        raise ValueError(f"unknown critic-free estimator {estimator!r}; expected 'grpo' or 'rloo'")
    adv = torch.where(zero_std, s.new_zeros(()), adv)
    return adv, zero_std, group_std


# --------------------------------------------------------------------------- #
# losses
# --------------------------------------------------------------------------- #
def loss_units(mask: Tensor, aggregation: str) -> Tensor:
    """What the normaliser of :func:`aggregate_loss` counts, on this batch:
    real tokens (``token_mean``) or sequences with at least one real token
    (``seq_mean_*``). Summed over every rank's part of a minibatch (one
    all-reduce per epoch, by the caller) it is the GLOBAL normaliser."""
    m = mask.bool()
    if aggregation == "token_mean":
        return m.sum()
    if aggregation in LOSS_AGGREGATIONS:
        return m.any(-1).sum()
    raise ValueError(f"unknown loss aggregation {aggregation!r}; expected one of {', '.join(LOSS_AGGREGATIONS)}")


def aggregate_loss(
    per_token: Tensor,
    mask: Tensor,
    aggregation: str,
    normaliser: float | Tensor,
    max_len: int | None = None,
) -> Tensor:
    """The one reduction of per-token losses ``(B, T)`` to the loss (0-dim).

    * ``token_mean``: ``sum_{i,t} l_it / N_tokens`` (DAPO, TRL ``bnpo``/``dapo``,
      veRL ``token-mean``).
    * ``seq_mean_token_mean``: ``sum_i (sum_t l_it / |o_i|) / N_seqs`` (the GRPO
      paper, TRL ``grpo``, veRL ``seq-mean-token-mean``).
    * ``seq_mean_token_sum``: ``sum_{i,t} l_it / (max_len * N_seqs)`` (Dr. GRPO,
      TRL ``dr_grpo``, veRL ``seq-mean-token-sum-norm``).

    ``normaliser`` is ``N_tokens`` or ``N_seqs`` of the GLOBAL minibatch (see
    :func:`loss_units`), divided by the number of processes when their
    gradients are averaged: each process's part then sums to the loss of the
    whole minibatch, whatever the split over processes and micro-batches.
    Padding is never read (masked sums).
    """
    m = _bool_mask(mask, per_token)
    if aggregation == "token_mean":
        return masked_sum(per_token, m) / normaliser
    if aggregation == "seq_mean_token_mean":
        per_seq = masked_sum(per_token, m, dim=-1) / m.sum(-1).clamp(min=1).to(per_token.dtype)  # (B,)
        return per_seq.sum() / normaliser
    if aggregation == "seq_mean_token_sum":
        if not max_len:
            raise ValueError("seq_mean_token_sum needs max_len (generation.max_new_tokens)")
        return masked_sum(per_token, m) / max_len / normaliser
    raise ValueError(f"unknown loss aggregation {aggregation!r}; expected one of {', '.join(LOSS_AGGREGATIONS)}")



def _zero_pad(x: Tensor, m: Tensor) -> Tensor:
    return torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device))


def _normaliser(mask: Tensor, num_tokens: float | Tensor | None, like: Tensor,
                aggregation: str = "token_mean") -> Tensor | float:
    if num_tokens is None:
        return loss_units(_bool_mask(mask, like), aggregation).clamp(min=1).to(_float_dtype(like))
    return num_tokens


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_range: float,
    num_tokens: float | Tensor | None = None,
    clip_range_high: float | None = None,
    aggregation: str = "token_mean",
    max_len: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate objective (Schulman et al. 2017, eq. 7), as a loss.

    Per token: ``max(-A * r, -A * clip(r, 1 - eps, 1 + eps))`` with
    ``r = exp(lp - old_lp)``.

    The loss is a masked SUM divided by ``num_tokens`` rather than a local
    masked mean: with a global token count the gradient of a minibatch split
    over N processes (then averaged/summed by the caller) equals the
    single-process gradient, which a per-rank mean does not guarantee when
    ranks hold different numbers of tokens.

    Args:
        logprobs: ``(B, T)`` current log-probs (requires grad).
        old_logprobs: ``(B, T)`` log-probs at rollout time.
        advantages: ``(B, T)``.
        mask: ``(B, T)``.
        clip_range: epsilon (the lower side; the upper too unless
            ``clip_range_high``).
        num_tokens: normaliser (must be > 0); default ``mask.sum()``
            clamped to at least 1. With a ``seq_mean_*`` aggregation it is the
            number of sequences (see :func:`aggregate_loss`).
        clip_range_high: upper epsilon (DAPO "clip-higher", Yu et al. 2025):
            the ratio is clipped to ``[1 - clip_range, 1 + clip_range_high]``.
        aggregation, max_len: see :func:`aggregate_loss`.

    Returns:
        ``(loss, stats)``: 0-dim loss; detached local masked-mean stats
        ``clipfrac`` (fraction of real tokens where the clipped branch is
        strictly larger, i.e. has zero gradient), ``approx_kl``
        (``0.5 * (lp - old_lp)^2``, the k2 estimator) and ``ratio``.
    """
    m = _bool_mask(mask, logprobs)
    # Zero the inputs at padding *before* the math: masking only the output
    # would still let inf/nan padding poison the backward pass (nan * 0).
    logprobs, old_logprobs, advantages = (_zero_pad(t, m) for t in (logprobs, old_logprobs, advantages))
    log_ratio = logprobs - old_logprobs  # (B, T)
    ratio = torch.exp(log_ratio)  # (B, T)
    pg_unclipped = -advantages * ratio  # (B, T)
    high = clip_range if clip_range_high is None else clip_range_high
    pg_clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + high)  # (B, T)
    per_token = torch.maximum(pg_unclipped, pg_clipped)  # (B, T)
    loss = aggregate_loss(per_token, m, aggregation, _normaliser(m, num_tokens, per_token, aggregation), max_len)
    with torch.no_grad():
        stats = {
            "clipfrac": masked_mean((pg_clipped > pg_unclipped).to(per_token.dtype), m),
            "approx_kl": masked_mean(0.5 * log_ratio.square(), m),
            "ratio": masked_mean(ratio, m),
        }
    return loss, {k: s.detach() for k, s in stats.items()}


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip_range_value: float,
    num_tokens: float | Tensor | None = None,
    aggregation: str = "token_mean",
    max_len: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss, as in OpenAI baselines ``ppo2`` and trlx.

    Per token: ``0.5 * max((v - R)^2, (clip(v, old - eps, old + eps) - R)^2)``.
    Not in the PPO paper; baselines introduced it and trlx/TRL keep it. Taking
    the max makes it a pessimistic bound, so values cannot move more than
    ``eps`` away from the rollout values in one step to reduce the loss.

    Args:
        values: ``(B, T)`` current value predictions (requires grad).
        old_values: ``(B, T)`` values at rollout time.
        returns: ``(B, T)`` targets (from :func:`gae`).
        mask: ``(B, T)``.
        clip_range_value: epsilon for values.
        num_tokens, aggregation, max_len: as in :func:`policy_loss`.

    Returns:
        ``(loss, stats)`` with detached local stats ``clipfrac`` and ``error``
        (mean of unclipped ``(v - R)^2`` over real tokens).
    """
    m = _bool_mask(mask, values)
    # zero padding before the math so garbage there cannot reach the gradient
    values, old_values, returns = (_zero_pad(t, m) for t in (values, old_values, returns))
    v_clipped = old_values + torch.clamp(values - old_values, -clip_range_value, clip_range_value)  # (B, T)
    err_unclipped = (values - returns).square()  # (B, T)
    err_clipped = (v_clipped - returns).square()  # (B, T)
    per_token = 0.5 * torch.maximum(err_unclipped, err_clipped)  # (B, T)
    loss = aggregate_loss(per_token, m, aggregation, _normaliser(m, num_tokens, per_token, aggregation), max_len)
    with torch.no_grad():
        stats = {
            "clipfrac": masked_mean((err_clipped > err_unclipped).to(per_token.dtype), m),
            "error": masked_mean(err_unclipped, m),
        }
    return loss, {k: s.detach() for k, s in stats.items()}


# --------------------------------------------------------------------------- #
# KL controllers
# --------------------------------------------------------------------------- #
class FixedKLController:
    """Constant KL coefficient; ``update`` is a no-op."""

    def __init__(self, kl_coef: float) -> None:
        self.value: float = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Does nothing (kept for interface parity with the adaptive controller)."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, section 2.2).

    ``e_t = clip(KL_t / KL_target - 1, -0.2, 0.2)``,
    ``beta_{t+1} = beta_t * (1 + K_beta * e_t)`` with ``K_beta = n_steps / horizon``
    (the paper uses K_beta = 0.1; trlx/TRL express it via a horizon).
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: int) -> None:
        if target <= 0:
            raise ValueError(f"target must be > 0, got {target}")
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self.value: float = float(init_kl_coef)
        self.target: float = float(target)
        self.horizon: float = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move beta towards keeping ``current_kl`` near ``target``."""
        proportional_error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])
        self.target = float(state["target"])
        self.horizon = float(state["horizon"])


# --------------------------------------------------------------------------- #
# running reward statistics
# --------------------------------------------------------------------------- #
class RunningMoments:
    """Running mean / std of scalar rewards, for reward scaling (as in trlx).

    Batches are folded in with the pairwise (parallel) variance combination
    of Chan, Golub & LeVeque (1979). State is held in Python floats (float64)
    so a ``state_dict`` round-trip through JSON resumes bit-exactly.

    Attributes:
        mean: running mean.
        var: running population variance (M2 / count).
        std: running unbiased std ``sqrt(var * count / (count - 1))``
            (population std while count <= 1).
        count: number of values seen (float).

    Before any update ``mean = 0, var = std = 1`` so scaling is the identity.
    """

    def __init__(self) -> None:
        self.mean: float = 0.0
        self.var: float = 1.0
        self.std: float = 1.0
        self.count: float = 0.0

    def update(self, xs: Tensor, reduce: ReduceFn | None = None) -> tuple[float, float]:
        """Fold a batch of scalars into the running statistics.

        Args:
            xs: ``(B,)`` (any shape; flattened) rewards of this process.
            reduce: sums ``[sum, sum_sq, count]`` over processes (called once),
                so every process folds in the same global batch (``G`` values).

        Returns:
            ``(mean, std)`` of THIS (global) batch, std unbiased. An empty
            global batch leaves the state unchanged and returns ``(0.0, 0.0)``.
        """
        flat = xs.detach().reshape(-1)  # (B,)
        sums = _local_moment_sums(flat, torch.ones_like(flat, dtype=torch.bool))  # (3,)
        if reduce is not None:
            sums = reduce(sums)
        mean_t, var_t, count_t = _moments_from_sums(sums, unbiased=False)
        n = float(count_t.item())
        if n == 0:
            return 0.0, 0.0
        b_mean, b_var = float(mean_t.item()), float(var_t.item())

        tot = self.count + n
        delta = b_mean - self.mean
        m2 = self.var * self.count + b_var * n + delta * delta * self.count * n / tot
        self.mean += delta * n / tot
        self.var = m2 / tot
        self.std = math.sqrt(self.var * tot / (tot - 1)) if tot > 1 else math.sqrt(self.var)
        self.count = tot

        b_std = math.sqrt(b_var * n / (n - 1)) if n > 1 else 0.0
        return b_mean, b_std

    def state_dict(self) -> dict[str, float]:
        return {"mean": self.mean, "var": self.var, "std": self.std, "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.mean = float(state["mean"])
        self.var = float(state["var"])
        self.std = float(state["std"])
        self.count = float(state["count"])


# --------------------------------------------------------------------------- #
# learning-rate schedule
# --------------------------------------------------------------------------- #
def lr_multiplier(step: int, total: int, warmup: int, kind: str) -> float:
    """Factor on the base learning rate at optimizer step ``step`` (0-based) of ``total``.

    Linear warm-up from ``1/warmup`` to 1 over ``warmup`` steps, then ``constant`` (1), ``linear``
    (1 -> 0) or ``cosine`` (1 -> 0, half a cosine) over the remaining ``total - warmup`` steps.
    """
    if warmup and step < warmup:
        return (step + 1) / warmup
    if kind == "constant" or total <= warmup:
        return 1.0
    p = min(1.0, (step - warmup) / max(1, total - warmup))
    if kind == "linear":
        return 1.0 - p
    if kind == "cosine":
        return 0.5 * (1 + math.cos(math.pi * p))
    raise ValueError(f"unknown lr schedule {kind!r} (constant, linear or cosine)")
