"""The engine/trainer agreement stage (``generation.engine: vllm`` with ``rollout.logprobs_from: forward``):
the mismatch between the engine's sampling log-probs and the trainer's, logged as ``engine/*``, and the
correction ``ppo.engine_correction`` applied to the advantages (``ops.engine``: w >= 0 scales each token's
policy-gradient term, which is the same as scaling its advantage; the value loss is untouched). Global
over ranks: one sum all-reduce and one max all-reduce, only when the engine's log-probs exist."""

from __future__ import annotations

import dataclasses

from .. import dist, ops
from ..config import PPOConfig
from ..rollout import Advantages, Rollouts

BAND = (0.9, 1.1)  # engine/ratio_outside: the share of tokens whose ratio leaves this band (TRL #6789's)


@dist.stage("engine correction")
def engine_correction(ro: Rollouts, adv: Advantages, ppo: PPOConfig,
                      policy_version: int) -> tuple[Advantages, dict[str, float]]:
    """``adv`` with the correction applied and the ``engine/*`` metrics; unchanged and {} when the rollouts
    hold no separate engine log-probs. ``policy_version``: the optimizer phases behind the policy that the
    update starts from (the version every sample should carry in this synchronous loop)."""
    if ro.engine_logprobs is None:
        return adv, {}
    m = ro.action_mask
    sums = ops.engine_mismatch_sums(ro.logprobs, ro.engine_logprobs, m, BAND)
    w = ops.engine_weights(ro.logprobs, ro.engine_logprobs, m, ppo.engine_correction, ppo.engine_correction_cap,
                           (ppo.engine_correction_low, ppo.engine_correction_high), ppo.engine_correction_level)  # (B, T)
    lag = max((policy_version - v for v in ro.versions), default=0)
    total = dist.reduce_stats({"tokens": sums["tokens"], "abs": sums["abs_diff_sum"], "outside": sums["outside"],
                               "w": float(w.sum()), "zero": float(((w == 0) & m).sum())})
    top = dist.reduce_max({"abs": sums["abs_diff_max"], "lag": float(lag)})
    n = max(1.0, total["tokens"])
    metrics = {"engine/logprob_abs_diff_mean": total["abs"] / n, "engine/logprob_abs_diff_max": top["abs"],
               "engine/ratio_outside_0.9_1.1": total["outside"] / n, "engine/version_lag": top["lag"]}
    if ppo.engine_correction != "none":
        metrics |= {"engine/correction_weight_mean": total["w"] / n, "engine/correction_zeroed": total["zero"] / n}
        adv = dataclasses.replace(adv, advantages=adv.advantages * w)
    return adv, metrics
