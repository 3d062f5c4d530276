"""KL-coefficient controllers and the learning-rate schedule (plain Python floats, no tensors)."""

from __future__ import annotations

import math
from typing import Any


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
