"""Engine/trainer agreement: the ratio between the log-probs the trainer computes for sampled tokens and
the ones the generation engine sampled them with, its correction weights and its statistics.

With a separate engine (vLLM) the tokens come from the engine's numerics, mu, while PPO's old log-probs
come from the trainer's forward of the same weights, pi_old. Per action token the ratio is

    r = pi_old / mu = exp(logp_trainer - logp_engine)

and ``engine_weights`` turns it into a weight w >= 0 on the policy-gradient term of that token:

* ``tis``  (truncated importance sampling): w = min(r, C).
* ``mask``, level ``token``: w = 1 if low <= r <= high else 0.
* ``mask``, level ``sequence``: one ratio per sequence, the geometric mean of its tokens' ratios
  exp(mean_t log r_t) (a product of T ratios explodes with T: TRL #4772), and w = 1 on all its tokens
  if low <= it <= high else 0.

Because w >= 0, w * min(rho A, clip(rho) A) = min(rho (w A), clip(rho) (w A)): the correction is the same
as scaling the token's advantage by w, which is how the trainer applies it. Both log-probs must be over
the same support (the full vocabulary at the sampling temperature; config.engine_logprobs_exact).

Shapes: ``B`` rows, ``T`` response length; masks True on action tokens (holes allowed: a hole is not a
token of the sequence).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .common import bool_mask, zero_outside

ENGINE_CORRECTIONS = ("none", "tis", "mask")


def engine_log_ratio(trainer_logprobs: Tensor, engine_logprobs: Tensor, mask: Tensor) -> Tensor:
    """(B, T) log r = trainer - engine log-prob on the mask, 0 elsewhere (float32 or wider)."""
    m = bool_mask(mask, trainer_logprobs)
    d = trainer_logprobs.double() - engine_logprobs.double()
    return zero_outside(d, m)


def engine_weights(trainer_logprobs: Tensor, engine_logprobs: Tensor, mask: Tensor, mode: str, cap: float = 2.0,
                   bounds: tuple[float, float] = (0.5, 2.0), level: str = "token") -> Tensor:
    """(B, T) weight of each token's policy-gradient term (see the module docstring); 0 off the mask,
    1 everywhere on it for ``none``. float32."""
    m = bool_mask(mask, trainer_logprobs)
    if mode == "none":
        return m.float()
    log_r = engine_log_ratio(trainer_logprobs, engine_logprobs, m)  # (B, T)
    if mode == "tis":
        w = torch.exp(torch.clamp(log_r, max=math.log(cap)))
    elif mode == "mask":
        lo, hi = math.log(bounds[0]) if bounds[0] > 0 else -math.inf, math.log(bounds[1])
        if level == "token":
            w = ((log_r >= lo) & (log_r <= hi)).double()
        elif level == "sequence":
            n = m.sum(1).clamp(min=1)  # (B,)
            seq = log_r.sum(1) / n  # (B,) log of the geometric mean ratio
            w = ((seq >= lo) & (seq <= hi)).double().unsqueeze(1).expand_as(log_r)
        else:
            raise ValueError(f"unknown engine correction level {level!r}; expected token or sequence")
    else:
        raise ValueError(f"unknown engine correction {mode!r}; expected one of {ENGINE_CORRECTIONS}")
    return zero_outside(w, m).float()


def engine_mismatch_sums(trainer_logprobs: Tensor, engine_logprobs: Tensor, mask: Tensor,
                         band: tuple[float, float] = (0.9, 1.1)) -> dict[str, float]:
    """This process's sums for the mismatch statistics (reduced over processes by the caller): ``tokens``,
    ``abs_diff_sum`` (sum of |log r|), ``abs_diff_max`` (max |log r|; reduce with a max), ``outside``
    (tokens with r outside ``band``)."""
    m = bool_mask(mask, trainer_logprobs)
    log_r = engine_log_ratio(trainer_logprobs, engine_logprobs, m)  # (B, T), 0 off the mask
    a = log_r.abs()
    out = (log_r < math.log(band[0])) | (log_r > math.log(band[1]))
    return {"tokens": float(m.sum()), "abs_diff_sum": float(a.sum()),
            "abs_diff_max": float(a.max()) if a.numel() else 0.0, "outside": float((out & m).sum())}
