"""Mask and dtype helpers shared by the ops modules (see the package docstring for the conventions)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

ReduceFn = Callable[[Tensor], Tensor]
"""Sums a 1-D float tensor over all processes and returns the sum (same shape)."""


def bool_mask(mask: Tensor, like: Tensor) -> Tensor:
    """Return ``mask`` as a bool tensor expanded to ``like.shape``."""
    m = mask if mask.dtype == torch.bool else mask != 0
    return m.expand(like.shape)


def float_dtype(x: Tensor) -> torch.dtype:
    """``x.dtype`` if floating, else float32 (so means of int/bool tensors work)."""
    return x.dtype if x.is_floating_point() else torch.float32


def zero_outside(x: Tensor, m: Tensor) -> Tensor:
    """``x`` where the bool mask ``m`` is True, 0 elsewhere.

    ``torch.where`` rather than ``x * m``: garbage (inf/nan) outside the mask
    cannot turn into NaN via ``inf * 0``, in the values or in the gradient.
    """
    return torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device))
