"""DAPO's dynamic sampling (Yu et al. 2025, arXiv 2503.14476, section 3.2): draw prompts and generate their groups
until the batch holds ``num_rollouts / G`` groups whose rewards are not all equal.

**Rounds.** A round draws the batch plan's ``num_rollouts / G`` prompts from the shared sampler and runs
the ordinary rollout stage on them (generation, the central reward step, the scoring passes): a round is an
ordinary iteration's batch, with the same chunk rounds on every rank. After it every rank gathers every
sample's (global index, group, score) and finds, from the same arrays in global-index order, the groups
whose scores differ (``ops.group_spread``). So the decision is global and the same for any number of
processes, any split of a group over ranks and any reward placement.

**Selection** (``Selection``, pure). Groups with a spread are kept in (round, group id) order until the batch
is full; the rest of a round's are surplus (``unused``, dropped as veRL drops them). Zero-spread groups are
discarded, the earliest of them held in reserve, as many as the batch still lacks. If ``max_rounds`` pass
first, the reserve fills the batch: these FILLER groups keep it at ``num_rollouts`` rows, so every rank's
minibatches and fsdp's equal micro-batch counts (checked by the batch plan) hold, and they are left out of
the loss, its normaliser and the group statistics (``Rollouts.filler``): the update trains on what there is.

**The batch.** Kept group ``k`` (then the filler groups) becomes group ``k`` of the iteration and its member
``m`` global sample ``k * G + m``; the rows then move to the ranks the batch plan gives those indices
(``dist.exchange_objects``: an even split in global-index order), each rank's in global-index order.

**Resume.** Nothing but the prompt sampler's position carries over to the next iteration (surplus groups
are dropped), and it is in every checkpoint: a resumed run redoes an iteration's rounds bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from .. import dist, ops
from ..config import BatchPlan
from ..reward.step import StepStats
from .batch import Rollouts, Shard

Collected = tuple[Rollouts, StepStats, dict[str, float]]


@dataclass
class Selection:
    """Which groups of which rounds make the batch: ``(round, group id)`` pairs. The same on every rank."""

    need: int  # groups in a full batch (num_rollouts / G)
    kept: list[tuple[int, int]] = field(default_factory=list)  # groups with a spread, in order
    reserve: list[tuple[int, int]] = field(default_factory=list)  # zero-spread groups, earliest first
    rounds: int = 0
    discarded: int = 0  # zero-spread groups drawn
    unused: int = 0  # groups with a spread drawn after the batch was full

    def add(self, spread: Sequence[bool]) -> None:
        """The next round's groups, by id: whether each one's scores differ."""
        r = self.rounds
        self.rounds += 1
        for g, varies in enumerate(spread):
            if not varies:
                self.discarded += 1
                self.reserve.append((r, g))
            elif len(self.kept) < self.need:
                self.kept.append((r, g))
            else:
                self.unused += 1
        del self.reserve[self.need - len(self.kept):]  # only as many as could still be needed

    @property
    def full(self) -> bool:
        return len(self.kept) >= self.need

    def batch(self) -> list[tuple[int, int]]:
        """The batch's groups in their new order: the kept ones, then fillers from the reserve."""
        return self.kept + self.reserve[: self.need - len(self.kept)]


@dist.stage("dynamic sampling")
def sample_groups(draw: Callable[[], Shard], collect: Callable[[Shard], Collected], plan: BatchPlan,
                  max_rounds: int, reward_clip: float | None, pad_id: int) -> Collected:
    """Rounds of ``collect(draw())`` until ``plan.prompts_per_iteration`` groups with a spread are in (or
    ``max_rounds``), then the batch on this rank (see the module docstring), the reward steps' stats summed,
    and the rounds' times summed plus the ``rollout/*`` metrics (docs/metrics.md)."""
    sel = Selection(plan.prompts_per_iteration)
    pieces: dict[int, Rollouts] = {}  # round -> this rank's rows of that round's groups still in sel
    total, times = StepStats(), {}
    while not sel.full and sel.rounds < max_rounds:
        ro, stats, t = collect(draw())
        total.add(stats)
        times = {k: times.get(k, 0.0) + v for k, v in t.items()}
        sel.add(_spread(ro, reward_clip, sel.need))
        pieces[sel.rounds - 1] = ro
        wanted = set(sel.kept) | set(sel.reserve)  # drop rows no longer needed (surplus, spent reserve)
        pieces = {r: p.select([i for i, g in enumerate(p.group) if (r, g) in wanted]) for r, p in pieces.items()}
    ro = _rebalance(_relabel(pieces, sel, plan.samples_per_prompt), plan, pad_id)
    return ro, total, times | {
        "rollout/sampling_rounds": float(sel.rounds), "rollout/groups_discarded": float(sel.discarded),
        "rollout/groups_unused": float(sel.unused), "rollout/short_groups": float(sel.need - len(sel.kept))}


def filter_scores(ro: Rollouts, reward_clip: float | None) -> torch.Tensor:
    """(B,) float64: the score whose spread decides, as the estimator reads it before any KL term (the
    scalar score after ``ppo.reward_clip``, plus the dense rewards). ``ppo.reward_scaling`` divides every
    score by one positive number, which leaves equal scores equal, so it is not applied."""
    scores = ro.scores if reward_clip is None else ro.scores.clamp(-reward_clip, reward_clip)
    dense = ro.dense_scores.sum(1).double() if ro.dense_scores is not None else 0.0
    return scores.double() + dense


def _spread(ro: Rollouts, reward_clip: float | None, groups: int) -> list[bool]:
    """Per group id of this round: whether its members' scores differ, from every rank's samples (one
    all-gather; the same arrays in global-index order on every rank)."""
    parts = dist.all_gather_objects((ro.global_index, ro.group, filter_scores(ro, reward_clip).tolist()))
    index = torch.tensor([i for p in parts for i in p[0]])  # (N,)
    order = torch.argsort(index)
    ids = torch.tensor([g for p in parts for g in p[1]])[order]  # (N,)
    scores = torch.tensor([s for p in parts for s in p[2]], dtype=torch.float64)[order]  # (N,)
    spread = ops.group_spread(scores, ids).tolist()
    return spread + [False] * (groups - len(spread))


def _relabel(pieces: dict[int, Rollouts], sel: Selection, G: int) -> list[Rollouts]:
    """This rank's rows of the batch's groups with their new group ids, global indices and filler flags."""
    new_id = {rg: k for k, rg in enumerate(sel.batch())}
    out = []
    for r, p in sorted(pieces.items()):
        rows = [i for i, g in enumerate(p.group) if (r, g) in new_id]
        if not rows:
            continue
        q = p.select(rows)
        ids = [new_id[(r, g)] for g in q.group]
        out.append(replace(q, group=ids, global_index=[k * G + i % G for k, i in zip(ids, q.global_index)],
                           filler=[k >= len(sel.kept) for k in ids]))
    return out


def _rebalance(parts: list[Rollouts], plan: BatchPlan, pad_id: int) -> Rollouts:
    """Move each row to the rank the batch plan gives its global index; this rank's rows, in order."""
    W = plan.world_size
    bounds = torch.tensor([plan.offset(r) + plan.local_count(r) for r in range(W)])  # (W,) ends of the ranks
    outgoing: list[list[Rollouts]] = [[] for _ in range(W)]
    for p in parts:
        dest = torch.searchsorted(bounds, torch.tensor(p.global_index), right=True).tolist()  # (b,)
        for d in sorted(set(dest)):
            outgoing[d].append(p.select([i for i, x in enumerate(dest) if x == d]))
    mine = [p for received in dist.exchange_objects(outgoing) for p in received]
    ro = Rollouts.concat(mine, pad_id)
    return ro.select(torch.argsort(torch.tensor(ro.global_index)).tolist())
