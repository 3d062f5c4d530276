"""Loss aggregation and the policy / value losses (per-token losses reduced by one contract).

Policy losses: the PPO clipped surrogate (:func:`policy_loss`, with a token or a sequence (GSPO)
importance ratio and an optional dual clip) and CISPO (:func:`cispo_loss`). docs/algorithms.md has
each formula with its reference and the peers' names for it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .common import bool_mask, float_dtype, zero_outside
from .stats import masked_mean, masked_sum

LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")
RATIO_LEVELS = ("token", "sequence")
POLICY_LOSSES = ("ppo", "cispo")


def loss_units(mask: Tensor, aggregation: str) -> Tensor:
    """What the normaliser of :func:`aggregate_loss` counts, on this batch:
    action tokens (``token_mean``) or sequences with at least one action token
    (``seq_mean_*``); holes and padding count for nothing, and a row with no
    action token is no sequence. Summed over every rank's part of a minibatch (one
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
      paper, TRL ``grpo``, veRL ``seq-mean-token-mean``); ``|o_i|`` is the
      number of action tokens of row ``i``.
    * ``seq_mean_token_sum``: ``sum_{i,t} l_it / (max_len * N_seqs)`` (Dr. GRPO,
      TRL ``dr_grpo``, veRL ``seq-mean-token-sum-norm``).

    ``normaliser`` is ``N_tokens`` or ``N_seqs`` of the GLOBAL minibatch (see
    :func:`loss_units`), divided by the number of processes when their
    gradients are averaged: each process's part then sums to the loss of the
    whole minibatch, whatever the split over processes and micro-batches.
    ``mask`` is the action mask: holes and padding are never read (masked
    sums) and never counted. ``max_len`` is whatever length budget the caller
    normalises by (today ``generation.max_new_tokens``).
    """
    m = bool_mask(mask, per_token)
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


def _normaliser(mask: Tensor, num_tokens: float | Tensor | None, like: Tensor,
                aggregation: str = "token_mean") -> Tensor | float:
    if num_tokens is None:
        return loss_units(bool_mask(mask, like), aggregation).clamp(min=1).to(float_dtype(like))
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
    ratio_level: str = "token",
    dual_clip: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate objective (Schulman et al. 2017, eq. 7), as a loss.

    Per token: ``max(-A * r, -A * clip(r, 1 - eps, 1 + eps))`` with
    ``r = exp(lp - old_lp)`` (``ratio_level="token"``) or GSPO's sequence
    ratio (``"sequence"``: :func:`sequence_log_ratio`, the same value on every
    action token of a row). With ``dual_clip = c`` (Ye et al. 2020, dual-clip
    PPO) a token with ``A < 0`` has its loss capped at ``-c * A``: the ratio's
    upward pull on a bad action is bounded however large ``r`` grows.

    The loss is a masked SUM divided by ``num_tokens`` rather than a local
    masked mean: with a global token count the gradient of a minibatch split
    over N processes (then averaged/summed by the caller) equals the
    single-process gradient, which a per-rank mean does not guarantee when
    ranks hold different numbers of tokens.

    Args:
        logprobs: ``(B, T)`` current log-probs (requires grad).
        old_logprobs: ``(B, T)`` log-probs at rollout time.
        advantages: ``(B, T)``.
        mask: ``(B, T)`` action mask (may have holes: not counted, as padding).
        clip_range: epsilon (the lower side; the upper too unless
            ``clip_range_high``).
        num_tokens: normaliser (must be > 0); default ``mask.sum()``
            clamped to at least 1. With a ``seq_mean_*`` aggregation it is the
            number of sequences (see :func:`aggregate_loss`).
        clip_range_high: upper epsilon (DAPO "clip-higher", Yu et al. 2025):
            the ratio is clipped to ``[1 - clip_range, 1 + clip_range_high]``.
        aggregation, max_len: see :func:`aggregate_loss`.
        ratio_level: ``"token"`` or ``"sequence"`` (GSPO).
        dual_clip: ``c > 1``, or None (off).

    Returns:
        ``(loss, stats)``: 0-dim loss; detached local masked-mean stats
        ``clipfrac`` (fraction of action tokens where a clip binds: the
        clipped branch is strictly larger, or the dual clip caps the loss;
        either way the token has zero gradient), ``approx_kl``
        (``0.5 * (lp - old_lp)^2``, the k2 estimator, per token whatever the
        ratio level) and ``ratio`` (the ratio used, per token).
    """
    # (Over 60 lines only by its docstring: the formula, its variants and each output's definition are
    # the reference docs/algorithms.md cites; the computation is the ~25 lines below.)
    m = bool_mask(mask, logprobs)
    # Zero the inputs at padding *before* the math: masking only the output
    # would still let inf/nan padding poison the backward pass (nan * 0).
    logprobs, old_logprobs, advantages = (zero_outside(t, m) for t in (logprobs, old_logprobs, advantages))
    log_ratio = logprobs - old_logprobs  # (B, T)
    ratio = _ratio(log_ratio, logprobs, old_logprobs, m, ratio_level)  # (B, T)
    pg_unclipped = -advantages * ratio  # (B, T)
    high = clip_range if clip_range_high is None else clip_range_high
    pg_clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + high)  # (B, T)
    per_token = torch.maximum(pg_unclipped, pg_clipped)  # (B, T)
    clipped = pg_clipped > pg_unclipped  # (B, T)
    if dual_clip is not None:
        # Only A < 0 (holes and padding have A = 0 here): min(per_token, -c * A), constant, so no gradient.
        cap = -advantages * dual_clip  # (B, T)
        capped = (advantages < 0) & (per_token > cap)  # (B, T)
        per_token, clipped = torch.where(capped, cap, per_token), clipped | capped
    loss = aggregate_loss(per_token, m, aggregation, _normaliser(m, num_tokens, per_token, aggregation), max_len)
    with torch.no_grad():
        stats = {
            "clipfrac": masked_mean(clipped.to(per_token.dtype), m),
            "approx_kl": masked_mean(0.5 * log_ratio.square(), m),
            "ratio": masked_mean(ratio, m),
        }
    return loss, {k: s.detach() for k, s in stats.items()}


def _ratio(log_ratio: Tensor, logprobs: Tensor, old_logprobs: Tensor, m: Tensor, level: str) -> Tensor:
    """The importance ratio ``(B, T)`` of ``ratio_level`` ``level`` (inputs already zeroed off ``m``)."""
    if level == "token":
        return torch.exp(log_ratio)
    if level == "sequence":
        return torch.exp(sequence_log_ratio(logprobs, old_logprobs, m))  # s_i on each token of row i
    raise ValueError(f"unknown ratio level {level!r}; expected one of {', '.join(RATIO_LEVELS)}")


def sequence_log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """GSPO's length-normalised sequence log-ratio (Zheng et al. 2025, "Group Sequence Policy
    Optimization", arXiv 2507.18071), in its token form (the paper's GSPO-token), as veRL's
    ``loss_mode=gspo``:

        log s_i = (1 / |y_i|) * sum_t (lp_it - old_lp_it)   over the ACTION tokens of row i
        log s_it = sg[log s_i] + lp_it - sg[lp_it]

    Its value at every token of row ``i`` is ``log s_i`` (``lp - sg[lp]`` is exactly 0); its gradient
    at token ``t`` is that of ``lp_it``. So ``exp`` of it times a per-sequence advantage has the same
    value and the same gradient as GSPO's sequence ratio ``s_i`` (``d s_i = s_i * mean_t d lp_it``,
    and the loss is aggregated over the row's tokens), and it still takes per-token advantages (GAE).

    Holes and padding are not counted in ``|y_i|`` and not read; a row with no action token gets 0.

    Args:
        logprobs: ``(B, T)`` current log-probs (requires grad).
        old_logprobs: ``(B, T)`` log-probs at rollout time.
        mask: ``(B, T)`` action mask.

    Returns:
        ``(B, T)`` log-ratios (0 at holes and padding of a row without action tokens; the row's
        value elsewhere).
    """
    m = bool_mask(mask, logprobs)
    diff = zero_outside(logprobs - old_logprobs, m)  # (B, T)
    per_seq = diff.sum(-1) / m.sum(-1).clamp(min=1).to(diff.dtype)  # (B,)
    lp = zero_outside(logprobs, m)
    return lp - lp.detach() + per_seq.detach().unsqueeze(-1)  # (B, T)


def cispo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float | None,
    clip_high: float,
    num_tokens: float | Tensor | None = None,
    aggregation: str = "token_mean",
    max_len: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1, Chen et al. 2025, arXiv 2506.13585), as a loss: the importance weight is clipped
    and its gradient stopped; every token keeps the gradient of its log-prob.

    Per token: ``-sg[clip(r, 1 - eps_low, 1 + eps_high)] * A * lp`` with ``r = exp(lp - old_lp)``.
    ``clip_low = None`` is no lower bound (the paper sets eps_low large, i.e. off). Unlike PPO's
    clip, no token is dropped from the gradient: a clipped weight only bounds how much it counts.

    Args:
        logprobs, old_logprobs, advantages, mask, num_tokens, aggregation, max_len: as in
            :func:`policy_loss`.
        clip_low: eps_low (the weight is at least ``1 - clip_low``), or None.
        clip_high: eps_high (the weight is at most ``1 + clip_high``; TRL's ``epsilon_high`` is
            ``1 + clip_high``).

    Returns:
        ``(loss, stats)`` with detached local masked means ``clipfrac`` (fraction of action tokens
        whose weight was clipped), ``approx_kl`` and ``ratio`` (the unclipped ``r``).
    """
    m = bool_mask(mask, logprobs)
    # zero padding before the math (see policy_loss)
    logprobs, old_logprobs, advantages = (zero_outside(t, m) for t in (logprobs, old_logprobs, advantages))
    log_ratio = logprobs - old_logprobs  # (B, T)
    ratio = torch.exp(log_ratio)  # (B, T)
    low = None if clip_low is None else 1.0 - clip_low
    weight = torch.clamp(ratio, min=low, max=1.0 + clip_high).detach()  # (B, T) stop-gradient
    per_token = -weight * advantages * logprobs  # (B, T)
    loss = aggregate_loss(per_token, m, aggregation, _normaliser(m, num_tokens, per_token, aggregation), max_len)
    with torch.no_grad():
        stats = {
            "clipfrac": masked_mean((weight != ratio).to(per_token.dtype), m),
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
        mask: ``(B, T)`` action mask (may have holes: not counted, as padding).
        clip_range_value: epsilon for values.
        num_tokens, aggregation, max_len: as in :func:`policy_loss`.

    Returns:
        ``(loss, stats)`` with detached local stats ``clipfrac`` and ``error``
        (mean of unclipped ``(v - R)^2`` over action tokens).
    """
    m = bool_mask(mask, values)
    # zero padding before the math so garbage there cannot reach the gradient
    values, old_values, returns = (zero_outside(t, m) for t in (values, old_values, returns))
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
