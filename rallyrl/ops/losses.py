"""Loss aggregation and the clipped policy / value losses (per-token losses reduced by one contract)."""

from __future__ import annotations

import torch
from torch import Tensor

from .common import bool_mask, float_dtype, zero_outside
from .stats import masked_mean, masked_sum

LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")


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
        mask: ``(B, T)`` action mask (may have holes: not counted, as padding).
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
        ``clipfrac`` (fraction of action tokens where the clipped branch is
        strictly larger, i.e. has zero gradient), ``approx_kl``
        (``0.5 * (lp - old_lp)^2``, the k2 estimator) and ``ratio``.
    """
    m = bool_mask(mask, logprobs)
    # Zero the inputs at padding *before* the math: masking only the output
    # would still let inf/nan padding poison the backward pass (nan * 0).
    logprobs, old_logprobs, advantages = (zero_outside(t, m) for t in (logprobs, old_logprobs, advantages))
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
