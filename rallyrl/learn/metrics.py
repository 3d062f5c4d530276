"""The iteration's logged statistics (``docs/metrics.md`` says what each means): global over all ranks,
from per-rank sums combined with ONE all-reduce."""

from __future__ import annotations

import math

from .. import dist
from ..config import BatchPlan
from ..reward.step import StepStats
from ..rollout import Advantages, Rollouts
from .state import TrainState


@dist.stage("statistics reduction")
def iteration_metrics(ro: Rollouts, adv: Advantages, rstats: StepStats, upd: dict[str, float],
                      names: list[str], state: TrainState, plan: BatchPlan) -> dict[str, float]:
    """Global statistics of the iteration, with ONE all-reduce (sums; means derived afterwards). ``value/*``
    only with a value head, ``policy/kl`` only with a reference (docs/metrics.md)."""
    g = dist.reduce_stats(_local_sums(ro, adv, rstats, upd, names))
    W = plan.world_size
    n = g["n"]
    k = n - g["unscorable"]  # samples with a reward: what reward/mean and reward/std are over
    mean = g["reward_sum"] / k if k else math.nan
    out = {
        "reward/mean": mean,
        "reward/std": math.sqrt(max(0.0, g["reward_sq"] / k - mean**2) * k / max(1.0, k - 1)) if k else math.nan,
        "reward/unscorable": g["unscorable"],
        "reward/calls": g["calls"],
        "reward/samples_per_call": g["samples"] / max(1.0, g["calls"]),
        "time/reward": g["time_reward"],
        "time/reward_gather": rstats.time_gather,  # this (main) rank's time moving samples and rewards
        "time/reward_wait": rstats.time_wait,  # this (main) rank's time blocked waiting for rewards
    }
    if adv.seq_kl is not None:
        out["policy/kl"] = g["kl_sum"] / n
    out |= _policy_metrics(g, state, W, with_kl=adv.seq_kl is not None)
    if "value_sum" in g:
        out |= _value_metrics(g, W)
    out |= adv.stats  # the estimator's own (grpo/rloo: group statistics; already global)
    if "ep_turns" in g:
        out |= _episode_metrics(g)
    if len(names) > 1:  # each over the samples the function scored (it returned None for the others)
        out.update({f"reward/{f}": g[f"c_{f}"] / g[f"k_{f}"] if g[f"k_{f}"] else math.nan for f in names})
    return out


def _local_sums(ro: Rollouts, adv: Advantages, rstats: StepStats, upd: dict[str, float],
                names: list[str]) -> dict[str, float]:
    """This rank's sums, reduced over ranks by ``iteration_metrics``. Per-token statistics are over the
    action mask (the sampled tokens); the response length counts every response token."""
    total = ro.total_rewards()  # (B,)
    scorable = ro.scorable
    if ro.episodes:  # multi-turn: an episode's reward is the sum over its rows (more than one after a fork)
        total, scorable = _per_episode_totals(ro, total)
    count = len(total)
    if scorable is not None:  # a sample without a reward is not in reward/mean and reward/std
        total = total[scorable]
    m = ro.action_mask
    critic = {}
    if adv.returns is not None and ro.values is not None:
        returns, resid = adv.returns, (adv.returns - ro.values) * m
        critic = {"value_sum": float((ro.values * m).sum()), "act_sum": float(m.sum()),
                  "ret_sum": float(returns.mul(m).sum()), "ret_sq": float(returns.double().pow(2).mul(m).sum()),
                  "res_sum": float(resid.sum()), "res_sq": float(resid.double().pow(2).sum())}
    return {
        **(_episode_sums(ro) if ro.episodes else {}),
        "n": float(count), "reward_sum": float(total.sum()), "reward_sq": float((total**2).sum()),
        "kl_sum": float(adv.seq_kl.sum()) if adv.seq_kl is not None else 0.0,
        "len_sum": float(ro.response_mask.sum()),
        **critic,
        "calls": float(rstats.calls), "samples": float(rstats.samples), "time_reward": rstats.time_reward,
        # The update's wall time is each rank's own (logged as the main rank's, time/update): a sum
        # over ranks means nothing, so it stays out of the reduction.
        **{f"u_{k}": v for k, v in upd.items() if k != "time"},
        **{f"c_{n}": float(sum(c.get(n, 0.0) for c in ro.reward_components)) for n in names},
        **{f"k_{n}": float(sum(n in c for c in ro.reward_components)) for n in names},
        "unscorable": float((~scorable).sum()) if scorable is not None else 0.0,
    }


def _per_episode_totals(ro: Rollouts, total: "torch.Tensor") -> tuple["torch.Tensor", "torch.Tensor | None"]:
    """(E,) each episode's reward from its rows' (B,) totals (a forked episode's rows share a global index),
    and (E,) whether it has one (None when every sample has)."""
    import torch

    index = torch.tensor(ro.global_index)
    uniq, inverse = torch.unique(index, return_inverse=True)
    scorable = None
    if ro.scorable is not None:
        scorable = torch.zeros(len(uniq), dtype=torch.bool).scatter(0, inverse, ro.scorable)
    return torch.zeros(len(uniq), dtype=total.dtype).index_add(0, inverse, total), scorable


def _episode_sums(ro: Rollouts) -> dict[str, float]:
    """This rank's sums over its multi-turn episodes (``episode/*``, docs/metrics.md)."""
    ts = [t for t in ro.episodes if t is not None]
    calls = [c for t in ts for turn in t["turns"] for c in turn["tool_calls"]]
    env = ro.response_mask & ~ro.action_mask
    return {"ep_n": float(len(ts)), "ep_turns": float(sum(len(t["turns"]) for t in ts)),
            "ep_tool_calls": float(len(calls)), "ep_tool_errors": float(sum(c["error"] is not None for c in calls)),
            "ep_truncated": float(sum(bool(t["truncated"]) for t in ts)), "ep_forks": float(sum(t["forks"] for t in ts)),
            "ep_env_reward": float(sum(r for t in ts for r in t["env_rewards"] if r is not None)),
            "ep_env_tokens": float(env.sum()), "ep_tokens": float(ro.response_mask.sum())}


def _episode_metrics(g: dict[str, float]) -> dict[str, float]:
    """``episode/*`` from the reduced sums: per-episode means and the environment's share of the tokens."""
    n = max(1.0, g["ep_n"])
    return {"episode/turns": g["ep_turns"] / n, "episode/tool_calls": g["ep_tool_calls"] / n,
            "episode/tool_errors": g["ep_tool_errors"] / n, "episode/truncated": g["ep_truncated"] / n,
            "episode/forks": g["ep_forks"] / n, "episode/env_reward": g["ep_env_reward"] / n,
            "episode/env_token_fraction": g["ep_env_tokens"] / max(1.0, g["ep_tokens"])}


def _policy_metrics(g: dict[str, float], state: TrainState, W: int, with_kl: bool) -> dict[str, float]:
    """``policy/*`` from the reduced sums: the update's per-step means and per-token rates."""
    n = g["n"]
    steps = max(1.0, g["u_steps"] / W)  # applied optimizer steps (identical on every rank)
    all_steps = max(1.0, (g["u_steps"] + g["u_skipped"]) / W)
    utok = max(1.0, g["u_tokens"])
    out = {
        "policy/kl_coef": state.kl_ctl.value,
        "policy/response_length": g["len_sum"] / n,
        "policy/loss": g["u_pg_loss"] / W / all_steps,
        "policy/clipfrac": g["u_clipfrac_tok"] / utok,
        "policy/approx_kl": g["u_approx_kl_tok"] / utok,
        "policy/entropy": g["u_entropy_tok"] / max(1.0, g["u_action_tokens"]),
        "policy/total_loss": g["u_loss"] / W / all_steps,
        "policy/grad_norm": g["u_grad_norm"] / W / steps,
        "policy/optimizer_steps": float(state.optimizer_steps),
        "policy/nonfinite_skips": float(state.nonfinite_skips),
    }
    if with_kl:
        out["policy/kl_loss"] = g["u_kl_loss"] / W / all_steps  # 0 unless ppo.kl_in: loss
    return out


def _value_metrics(g: dict[str, float], W: int) -> dict[str, float]:
    """``value/*`` from the reduced sums (a value head only), per action token."""
    tok = max(1.0, g["act_sum"])
    all_steps = max(1.0, (g["u_steps"] + g["u_skipped"]) / W)
    var_ret = g["ret_sq"] / tok - (g["ret_sum"] / tok) ** 2
    var_res = g["res_sq"] / tok - (g["res_sum"] / tok) ** 2
    return {
        "value/loss": g["u_vf_loss"] / W / all_steps,
        "value/clipfrac": g["u_vf_clipfrac_tok"] / max(1.0, g["u_tokens"]),
        "value/mean": g["value_sum"] / tok,
        "value/explained_variance": 1.0 - var_res / var_ret if var_ret > 1e-12 else 0.0,
    }
