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
shaping, GAE, group advantages and their spread, the overlong penalty),
``losses`` (loss aggregation; the PPO (token or GSPO sequence ratio, dual
clip) and CISPO policy losses; the value loss), ``control`` (KL controllers,
learning-rate schedule), ``engine`` (the engine/trainer log-prob ratio, its
correction weights and statistics). Import from here (``from rallyrl import ops; ops.gae(...)``): every public name is
re-exported.

Shape legend used in docstrings and ``# (B, T)`` comments:

* ``B`` -- local batch size (rows on this process)
* ``G`` -- global batch size (rows on all processes together)
* ``T`` -- response length (padded)
* ``V`` -- vocabulary size

Mask convention: ``mask`` is a bool (or 0/1) tensor, True for the tokens a
function counts. The trainer passes the ACTION mask: True on tokens the
policy sampled and is trained on. Responses are right-padded, and a mask may
have HOLES: False positions between Trues, e.g. ``[1 1 1 0 0 1 1 0 0]`` for a
row of two turns with an environment message (tool result) between them and
padding after. Values at False positions (holes or padding) are never read,
so they may hold garbage (even ``inf``/``nan``) without leaking into results.
What a hole means, function by function:

* masked sums, means, moments, whitening, loss aggregation, the policy and
  value losses and their statistics: a hole is not counted (as padding is);
  whitened values, rewards, advantages and returns are 0 there.
* :func:`penalized_rewards`: the score goes on the LAST action token of the
  row (its last True); KL penalties and dense rewards count on action tokens
  only.
* :func:`gae`: the advantage chain runs over the action tokens in order; a
  hole is skipped (no discount step, its reward and value ignored), not
  treated as the end of the episode.
* :func:`sequence_log_ratio` (GSPO): the mean over a row's ACTION tokens; a
  hole counts neither in the sum nor in the length ``|y_i|``.

On a mask without holes every function gives the same bits as before holes
were supported.
"""

from __future__ import annotations

from .advantages import gae, group_advantages, group_spread, overlong_penalty, penalized_rewards
from .common import ReduceFn
from .engine import ENGINE_CORRECTIONS, engine_log_ratio, engine_mismatch_sums, engine_weights
from .control import AdaptiveKLController, FixedKLController, lr_multiplier
from .logprobs import KL_ESTIMATORS, entropy_from_logits, kl_estimate, logprobs_from_logits
from .losses import (LOSS_AGGREGATIONS, POLICY_LOSSES, RATIO_LEVELS, aggregate_loss, cispo_loss, loss_units, policy_loss,
                     sequence_log_ratio, value_loss)
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
    "group_spread",
    "overlong_penalty",
    "loss_units",
    "aggregate_loss",
    "policy_loss",
    "sequence_log_ratio",
    "cispo_loss",
    "value_loss",
    "FixedKLController",
    "AdaptiveKLController",
    "RunningMoments",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "RATIO_LEVELS",
    "POLICY_LOSSES",
    "lr_multiplier",
    "ENGINE_CORRECTIONS",
    "engine_log_ratio",
    "engine_weights",
    "engine_mismatch_sums",
]
