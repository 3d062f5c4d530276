"""Masked statistics: sums, means, moments, whitening, and running moments of rewards.

A position whose mask is False (padding, or a hole: a token in the context
that the policy did not sample) is simply not counted: it adds nothing to a
sum, a mean, a count or a variance, and its value is never read.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from .common import ReduceFn, bool_mask, float_dtype, zero_outside


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``x`` over positions where ``mask`` is True.

    Args:
        x: any shape, e.g. ``(B, T)``.
        mask: same shape as ``x`` or expandable to it; bool or 0/1.
        dim: reduce only this dim (e.g. ``dim=-1`` gives ``(B,)``); None = all.

    ``torch.where`` rather than ``x * mask`` so garbage (inf/nan) at padded
    positions cannot turn into NaN via ``inf * 0``.
    """
    m = bool_mask(mask, x)
    kept = zero_outside(x, m)
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over masked positions; an empty mask (or empty row) gives 0.

    Args:
        x: any shape, e.g. ``(B, T)``.
        mask: same shape as ``x`` or expandable to it.
        dim: as in :func:`masked_sum`.
    """
    m = bool_mask(mask, x)
    dtype = float_dtype(x)
    total = masked_sum(x.to(dtype), m, dim)
    count = m.sum() if dim is None else m.sum(dim=dim)
    return total / count.clamp(min=1).to(dtype)


def _local_moment_sums(x: Tensor, mask: Tensor) -> Tensor:
    """``[sum, sum_sq, count]`` of masked elements as a float64 ``(3,)`` vector."""
    m = bool_mask(mask, x)
    x64 = zero_outside(x.double(), m)
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
    dtype = float_dtype(x)
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
        mask: ``(B, T)`` (the action mask; may have holes).
        shift_mean: if False, add the mean back after scaling, i.e. only the
            scale changes (trlx / TRL behaviour when whitening rewards, so
            their sign/offset carries information).
        reduce: as in :func:`masked_moments` (global statistics).
        eps: added to the variance before the square root.

    Returns:
        ``(B, T)`` in ``x.dtype``; zeros where ``mask`` is False. Holes, like
        padding, are left out of the mean and variance and come out as 0.
    """
    sums = _local_moment_sums(x, mask)  # (3,)
    if reduce is not None:
        sums = reduce(sums)
    mean, var, _ = _moments_from_sums(sums, unbiased=True)
    whitened = (x.double() - mean) * torch.rsqrt(var + eps)  # (B, T) float64
    if not shift_mean:
        whitened = whitened + mean
    m = bool_mask(mask, x)
    out = zero_outside(whitened, m)
    return out.to(float_dtype(x))


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

