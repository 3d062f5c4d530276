"""Stages 3+4 of the loop: reward shaping and advantages, for the estimator ``ppo.estimator`` names.

``gae``: per-token KL-shaped rewards and GAE over the value head's values; ``grpo``/``rloo``: group
statistics of one outcome score per sequence, computed over the GLOBAL batch by group id. Every per-token
quantity here is over the ``action_mask`` (the sampled tokens): environment tokens of a multi-turn
episode get no reward, no KL and no advantage (docs/algorithms.md). The loss mask is the action mask less
what the update must not train on: zero-std groups (``ppo.drop_zero_std_groups``), dynamic sampling's
filler groups and, with ``ppo.mask_truncated``, responses cut off by ``generation.max_new_tokens``.
"""

from __future__ import annotations

import torch

from .. import dist, ops
from ..config import PPOConfig
from ..rollout import Advantages, Rollouts
from .state import TrainState


@dist.stage("advantage estimation")
def compute_advantages(ro: Rollouts, state: TrainState, ppo: PPOConfig) -> Advantages:
    """``gae``: per-token KL-shaped rewards, GAE over the value head's values, optional global whitening.
    ``grpo``/``rloo``: one outcome score per sequence (score + its dense rewards; minus beta * its KL with
    ``kl_in: reward``), turned into advantages by ``ops.group_advantages`` over the GLOBAL batch, by
    group id: every rank gathers every sample's (index, group, score), so the statistics are the same
    whichever rank scored which sample and however groups straddle ranks (docs/algorithms.md)."""
    scores, dense = _scaled_scores(ro, state, ppo)
    m = ro.action_mask  # the loss, KL, value targets and whitening: sampled tokens only
    kl_tok = seq_kl = None
    if ro.ref_logprobs is not None:
        kl_tok = ops.kl_estimate(ro.logprobs, ro.ref_logprobs, ppo.kl_estimator) * m  # (B, T)
        seq_kl = (ro.logprobs - ro.ref_logprobs).mul(m).sum(1)  # (B,) k1 per sequence (the logged KL)
    beta = state.kl_ctl.value if ppo.kl_in == "reward" else 0.0
    if not ppo.critic_free:
        if ro.scorable is not None:
            # A sample without a reward (every function returned None) has no return to learn from: it
            # is left out of the update (no policy, value or KL loss; not in the whitening statistics).
            # Its KL still counts in policy/kl (seq_kl above): the policy did sample it.
            m = m & ro.scorable.unsqueeze(1)  # (B, T)
        kl = kl_tok if kl_tok is not None else torch.zeros_like(ro.logprobs)
        if any(ro.segment):  # a forked episode's earlier rows bootstrap from the row that continues it
            scores = scores + _fork_bootstrap(ro, ppo.gamma)
        rewards = ops.penalized_rewards(kl, m, beta, scores, dense)  # (B, T)
        adv, returns = ops.gae(rewards, ro.values, m, ppo.gamma, ppo.lam)  # (B, T)
        if ppo.whiten_advantages:
            # Global statistics: whitening per rank would give each rank a different advantage scale.
            adv = ops.masked_whiten(adv, m, reduce=dist.all_reduce_sum)
        first = adv[:, 0].tolist() if adv.shape[1] else [0.0] * len(ro)
        return Advantages(adv, returns, seq_kl, _trained(m, ro, ppo), first, _truncation_stats(ro, ppo))
    seq_score = scores.double() + (dense.sum(1).double() if dense is not None else 0.0)  # (B,)
    if kl_tok is not None and beta:
        seq_score = seq_score - beta * kl_tok.sum(1).double()  # TRL RLOO / OpenRLHF: KL in the reward
    index, groups, all_scores, filler, scorable = _global_batch(ro, seq_score)  # (N,) each, every rank
    adv_all, zero_all, group_std = _group_advantages(all_scores, groups, filler, scorable, ppo)
    # (B,) mine: each row's episode (the rows of a forked episode share its advantage)
    pos = torch.searchsorted(index, torch.tensor(ro.global_index, dtype=index.dtype))
    seq_adv, zero = adv_all[pos], zero_all[pos]  # (B,)
    adv = seq_adv.to(ro.logprobs.dtype).unsqueeze(1) * m  # (B, T): the outcome's advantage on every token
    loss_mask = m & ~zero.unsqueeze(1) if ppo.drop_zero_std_groups else m
    if filler.any():  # (only with dynamic sampling) present and zero-std counts are over trained groups
        groups, zero_all, adv_all = groups[~filler], zero_all[~filler], adv_all[~filler]
    present = torch.unique(groups)
    n_zero = int(torch.unique(groups[zero_all]).numel())
    stats = {"reward/group_std": float(group_std[present].mean()) if len(present) else 0.0,
             "reward/zero_std_groups": n_zero / max(1, int(present.numel())),
             "policy/advantage_abs": float(adv_all.abs().mean()) if len(adv_all) else 0.0}
    return Advantages(adv, None, seq_kl, _trained(loss_mask, ro, ppo), seq_adv.tolist(),
                      stats | _truncation_stats(ro, ppo))


def _global_batch(ro: Rollouts, seq_score: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                   torch.Tensor, torch.Tensor | None]:
    """Every rank's samples in global-index order, one entry per episode (the same arrays on every rank,
    whatever the layout): index, group, score, dynamic sampling's filler flag, and who has a reward
    (None when every sample has one)."""
    # every rank's samples; who has a reward where some sample has none (None otherwise); dynamic
    # sampling's filler groups (they stay out of the statistics)
    mine = (ro.global_index, ro.group, seq_score.tolist(), ro.filler,
            ro.scorable.tolist() if ro.scorable is not None else None)
    parts = dist.all_gather_objects(mine)
    index = torch.tensor([i for p in parts for i in p[0]])  # (N,)
    order = torch.argsort(index)  # global-index order: the same arrays on every rank, whatever the layout
    groups = torch.tensor([g for p in parts for g in p[1]])[order]  # (N,)
    all_scores = torch.tensor([x for p in parts for x in p[2]], dtype=torch.float64)[order]  # (N,)
    filler = torch.tensor([f for p in parts for f in (p[3] or [False] * len(p[0]))], dtype=torch.bool)[order]
    scorable = None  # (N,) bool: left out of their group's statistics, advantage 0 (TRL #5902)
    if any(p[4] is not None for p in parts):
        scorable = torch.tensor([x for p in parts for x in (p[4] or [True] * len(p[0]))])[order]
    index = index[order]
    if len(torch.unique(index)) < len(index):  # forked episodes (several rows): one score per episode
        # (dynamic sampling is refused with environments, so no row is a filler here)
        index, groups, all_scores, scorable = _per_episode(index, groups, all_scores, scorable)
        filler = torch.zeros(len(index), dtype=torch.bool)
    return index, groups, all_scores, filler, scorable


def _group_advantages(scores: torch.Tensor, groups: torch.Tensor, filler: torch.Tensor,
                      scorable: torch.Tensor | None, ppo: PPOConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``ops.group_advantages`` over the global batch, leaving out the samples without a reward and the
    filler groups (advantage 0; a group with no member left counts as zero-std): fillers only hold the
    batch's shape (rollout/dynamic.py) and must not move ``group_scale: batch``'s std."""
    keep = scorable
    if filler.any():
        keep = ~filler if keep is None else keep & ~filler
    return ops.group_advantages(scores, groups, ppo.estimator, ppo.group_scale, ppo.group_std_floor, keep)


def _trained(loss_mask: torch.Tensor, ro: Rollouts, ppo: PPOConfig) -> torch.Tensor:
    """The loss mask less the filler groups of dynamic sampling and, with ``ppo.mask_truncated``, the
    responses ``generation.max_new_tokens`` cut off (TRL's ``mask_truncated_completions``: they leave the
    loss and its normaliser, not the statistics computed before it)."""
    out = loss_mask & ~ro.flags("filler").unsqueeze(1) if ro.filler else loss_mask
    return out & ~ro.flags("truncated").unsqueeze(1) if ppo.mask_truncated else out


def _truncation_stats(ro: Rollouts, ppo: PPOConfig) -> dict[str, float]:
    """``rollout/truncated`` with ``ppo.mask_truncated``: the global fraction of responses left out of
    the loss for being cut off (one all-reduce)."""
    if not ppo.mask_truncated:
        return {}
    n = dist.all_reduce_sum(torch.tensor([float(ro.flags("truncated").sum()), float(len(ro))], dtype=torch.float64))
    return {"rollout/truncated": float(n[0] / n[1].clamp(min=1))}


def _per_episode(index: torch.Tensor, groups: torch.Tensor, scores: torch.Tensor, scorable: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Rows (sorted by global index; a forked episode's rows share it) -> one entry per episode: its index,
    group and score, the sum of its rows' scores (the episode's score sits on its last row, each row adds
    its own dense rewards and KL), and whether it has a reward (the same on each of its rows), so the group
    statistics count episodes, not rows."""
    uniq, inverse = torch.unique(index, sorted=True, return_inverse=True)  # (E,), (N,)
    summed = torch.zeros(len(uniq), dtype=torch.float64).index_add(0, inverse, scores)  # (E,)
    groups_e = torch.zeros(len(uniq), dtype=groups.dtype).scatter(0, inverse, groups)  # (E,)
    scorable_e = None if scorable is None else torch.zeros(len(uniq), dtype=torch.bool).scatter(0, inverse, scorable)
    return uniq, groups_e, summed, scorable_e


def _fork_bootstrap(ro: Rollouts, gamma: float) -> torch.Tensor:
    """(B,) ``gamma * V(s')`` for each row that a fork continued, where ``s'`` is the first action token
    of the episode's next row, else 0; added to the row's score, which the reward shaping places on its
    last action token. The GAE chain of an episode split over rows is then each row's own chain with a
    bootstrapped end (a truncated trajectory's usual treatment), instead of a terminal 0 mid-episode."""
    boot = torch.zeros(len(ro))
    if ro.values is None:
        return boot
    at = {(g, s): i for i, (g, s) in enumerate(zip(ro.global_index, ro.segment))}
    for i, (g, s) in enumerate(zip(ro.global_index, ro.segment)):
        j = at.get((g, s + 1))
        if j is not None:
            first = int(ro.action_mask[j].nonzero()[0])
            boot[i] = gamma * float(ro.values[j, first])
    return boot


def _scaled_scores(ro: Rollouts, state: TrainState, ppo: PPOConfig) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scores (B,) and dense rewards (B, T) after ``ppo.reward_scaling`` and ``ppo.reward_clip``."""
    scores, dense = ro.scores.clone(), ro.dense_scores
    if ppo.reward_scaling == "running":
        # Running std over all ranks (trlx "running" scaling): scale without shifting the mean. A sample
        # without a reward (score 0.0, unused) does not move it.
        seen = ro.scores if ro.scorable is None else ro.scores[ro.scorable]
        state.reward_moments.update(seen, reduce=dist.all_reduce_sum)
        scores = scores / max(state.reward_moments.std, 1e-8)
        dense = dense / max(state.reward_moments.std, 1e-8) if dense is not None else None
    if ppo.reward_clip is not None:
        scores = scores.clamp(-ppo.reward_clip, ppo.reward_clip)
    return scores, dense
