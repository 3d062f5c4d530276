"""Pure tensor math for PPO on language models.

Nothing in this package talks to other processes, reads a config object or
does I/O. Where a statistic has to be global across processes, the function
takes an optional ``reduce`` callable that sums a 1-D float tensor over all
processes (the collectives module supplies one; ``None`` means "this process
only"). Each statistics computation calls ``reduce`` exactly once, on one
stacked vector, so a multi-process run pays one collective per statistic
(made by the caller, in ``rallyrl.dist``).

Rooms: ``logprobs`` (log-probs, entropy, KL estimators), ``stats`` (masked
sums, means, moments, whitening, running moments), ``advantages`` (reward
shaping, GAE, group advantages), ``losses`` (loss aggregation, policy and
value losses), ``control`` (KL controllers, learning-rate schedule). Import
from here (``from rallyrl import ops; ops.gae(...)``): every public name is
re-exported.

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

from .advantages import gae, group_advantages, penalized_rewards
from .common import ReduceFn
from .control import AdaptiveKLController, FixedKLController, lr_multiplier
from .logprobs import KL_ESTIMATORS, entropy_from_logits, kl_estimate, logprobs_from_logits
from .losses import LOSS_AGGREGATIONS, aggregate_loss, loss_units, policy_loss, value_loss
from .stats import RunningMoments, masked_mean, masked_moments, masked_sum, masked_whiten

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
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "lr_multiplier",
]
