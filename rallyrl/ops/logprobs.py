"""Log-probabilities, entropy and per-token KL estimates from logits (no masks: mask the results)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

_LOW_PRECISION = (torch.float16, torch.bfloat16)
KL_ESTIMATORS = ("k1", "k2", "k3")


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
