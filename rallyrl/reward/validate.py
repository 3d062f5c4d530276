"""Validation of reward-function outputs, before anything is scattered to the ranks."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any


class RewardValidationError(ValueError):
    """The reward function returned something that is not one finite reward per sample."""


def _as_number(x: Any, where: str) -> float:
    import numpy as np
    import torch

    if isinstance(x, torch.Tensor):
        if x.numel() != 1:
            raise RewardValidationError(f"{where}: expected a number, got a tensor of shape {tuple(x.shape)}")
        x = x.item()
    elif isinstance(x, np.ndarray) and x.ndim == 0:
        x = x.item()
    if x is None:  # None is a whole sample's "unscorable", not one token's
        raise RewardValidationError(f"{where}: expected a number, got None (None means unscorable and stands "
                                    f"for a whole sample's reward, not for one token of a dense reward)")
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise RewardValidationError(f"{where}: expected a number, got {type(x).__name__} {x!r}")
    v = float(x)
    if not math.isfinite(v):
        raise RewardValidationError(f"{where}: reward is {v} (rewards must be finite)")
    return v


def validate_rewards(
    out: Any, output_lengths: Sequence[int], fn_name: str = "reward function", offset: int = 0
) -> list[float | list[float] | None]:
    """Check and normalise one reward call's output.

    Accepts a list/tuple, a 1-D tensor or array of scalars, or per-sample dense lists (a list or 1-D
    tensor per sample, aligned to the sample's output tokens and no longer than them); ``None`` for a
    sample means unscorable (as in TRL) and is kept. Returns a list with a float, a list of floats or
    None per sample. ``offset`` is the global index of the first sample of this call, so messages name
    the sample as the user sees it.
    """
    import numpy as np
    import torch

    n = len(output_lengths)
    if isinstance(out, (torch.Tensor, np.ndarray)):
        if out.ndim != 1:
            raise RewardValidationError(
                f"{fn_name} returned an array of shape {tuple(out.shape)}; expected {n} rewards "
                f"(a 1-D array, or a list with a per-token list for dense rewards)"
            )
        out = out.tolist()
    if isinstance(out, (str, bytes)) or not isinstance(out, Sequence):
        raise RewardValidationError(
            f"{fn_name} returned {type(out).__name__}; expected a list of {n} rewards"
        )
    if len(out) != n:
        raise RewardValidationError(f"{fn_name}: expected {n} rewards, got {len(out)}")
    result: list[float | list[float] | None] = []
    for i, r in enumerate(out):
        where = f"{fn_name}: sample {offset + i}"
        if r is None:
            result.append(None)
            continue
        if isinstance(r, (torch.Tensor, np.ndarray)) and r.ndim == 1:
            r = r.tolist()
        if isinstance(r, (list, tuple)):
            if len(r) > output_lengths[i]:
                raise RewardValidationError(
                    f"{where}: dense reward has {len(r)} values but the output has only "
                    f"{output_lengths[i]} tokens"
                )
            result.append([_as_number(x, f"{where} token {t}") for t, x in enumerate(r)])
        else:
            result.append(_as_number(r, where))
    return result
