"""The training batch: ``Rollouts`` (one rank's samples of an iteration), ``Advantages`` and ``Shard``.

Shapes: ``B`` samples on this rank, ``Q`` query length (left-padded), ``T`` response length
(right-padded), ``V`` vocab.

Two masks, never one:

- ``response_mask`` (with ``query_mask``) is the attention / padding mask: what the model SEES. True on
  every real response token; False only on the right padding. The forward passes and the column trim
  of the update use it.
- ``action_mask`` says what the policy SAMPLED and is trained on: the loss, the KL, value targets,
  whitening and every per-token statistic use it. A multi-turn episode's environment tokens (tool
  results, the environment's replies) are in the context but not actions: False there, so the mask can
  have holes. In a single-turn episode the two are equal.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from ..config import BatchPlan, split_evenly

if TYPE_CHECKING:
    from ..reward.step import Reward
    from .episode import Episodes
    from .scoring import Scored


@dataclass
class Rollouts:
    """One rank's training batch for an iteration (tensors on CPU)."""

    query_ids: torch.Tensor  # (B, Q) left-padded with pad_id
    query_mask: torch.Tensor  # (B, Q) bool
    response_ids: torch.Tensor  # (B, T) right-padded with pad_id
    response_mask: torch.Tensor  # (B, T) bool: attention (real tokens)
    action_mask: torch.Tensor  # (B, T) bool: sampled by the policy, trained on (see the module docstring)
    logprobs: torch.Tensor  # (B, T) of the sampling policy (temperature applied); 0 off the action mask
    ref_logprobs: torch.Tensor | None  # (B, T) of the frozen reference; None without a reference
    values: torch.Tensor | None  # (B, T); None without a value head
    scores: torch.Tensor  # (B,) scalar reward, placed on the last action token
    dense_scores: torch.Tensor | None  # (B, T) per-token reward, or None when no sample has one
    prompts: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    metadata: list[dict[str, Any]] = field(default_factory=list)
    global_index: list[int] = field(default_factory=list)  # the sample's index in the iteration's global batch
    group: list[int] = field(default_factory=list)  # group id (= global_index // samples_per_prompt)
    reward_components: list[dict[str, float]] = field(default_factory=list)
    # Multi-turn episodes only (empty for single-turn ones, where every row is a whole episode). A forked
    # episode spans several rows, all with its global_index; its score sits on its LAST row.
    segment: list[int] = field(default_factory=list)  # the row's place in its episode (0, 1, ... after forks)
    episodes: list[dict[str, Any] | None] = field(default_factory=list)  # the episode's transcript on its last row
    # A separate engine's (vLLM) sampling log-probs beside the trainer's `logprobs` (B, T), 0 off the action
    # mask; None when the engine is the trainer (hf) or its log-probs are the old log-probs (`generate`).
    engine_logprobs: torch.Tensor | None = None
    versions: list[int] = field(default_factory=list)  # per sample: the engine weight version that sampled it
    # (B,) bool: the sample has a reward (False: every reward function returned None; its score is 0.0
    # and unused). None: every sample has one, which is every run whose functions never return None.
    scorable: torch.Tensor | None = None
    # Per sample; an empty list means False for every sample (batches built by hand in tests).
    truncated: list[bool] = field(default_factory=list)  # cut by generation.max_new_tokens (no EOS, no stop)
    filler: list[bool] = field(default_factory=list)  # dynamic sampling: a group that only fills the batch
    #                                                   (rollout/dynamic.py): out of the loss and group statistics

    def __len__(self) -> int:
        return len(self.prompts)

    def flags(self, name: str) -> torch.Tensor:
        """(B,) bool: the per-sample flag ``truncated`` or ``filler`` (False everywhere when unset)."""
        values = getattr(self, name)
        return torch.tensor(values, dtype=torch.bool) if values else torch.zeros(len(self), dtype=torch.bool)

    def add_reward(self, name: str, values: torch.Tensor) -> None:
        """Add a per-sample reward that rallyrl computes itself (e.g. ``reward.overlong_buffer``'s penalty)
        to the scores, and record it as the reward component ``name`` (logged as ``reward/<name>``)."""
        if any(name in c for c in self.reward_components):
            raise ValueError(f"reward component {name!r} is already set (a reward function of that name?)")
        self.scores = self.scores + values.to(self.scores.dtype)
        comps = self.reward_components or [{} for _ in range(len(self))]
        self.reward_components = [{**c, name: float(v)} for c, v in zip(comps, values.tolist())]

    def select(self, rows: Sequence[int]) -> "Rollouts":
        """The samples ``rows`` (in that order), with every tensor and per-sample list."""
        idx = torch.tensor(list(rows), dtype=torch.long)

        def t(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else x[idx]

        def pick(xs: list[Any]) -> list[Any]:
            return [xs[i] for i in rows] if xs else []

        return Rollouts(
            query_ids=self.query_ids[idx], query_mask=self.query_mask[idx], response_ids=self.response_ids[idx],
            response_mask=self.response_mask[idx], action_mask=self.action_mask[idx], logprobs=self.logprobs[idx],
            ref_logprobs=t(self.ref_logprobs), values=t(self.values), scores=self.scores[idx],
            dense_scores=t(self.dense_scores), prompts=pick(self.prompts), outputs=pick(self.outputs),
            metadata=pick(self.metadata), global_index=pick(self.global_index), group=pick(self.group),
            reward_components=pick(self.reward_components), truncated=pick(self.truncated),
            filler=pick(self.filler), engine_logprobs=t(self.engine_logprobs), versions=pick(self.versions),
            scorable=t(self.scorable), segment=pick(self.segment), episodes=pick(self.episodes),
        )

    def total_rewards(self) -> torch.Tensor:
        """(B,) each sample's whole reward: the scalar score plus its dense per-token rewards (0.0 for an
        unscorable one: read ``scorable``)."""
        dense = self.dense_scores.sum(1).double() if self.dense_scores is not None else 0.0
        return self.scores.double() + dense  # float64: the logged value is the exact sum of the two parts

    def last_rows(self) -> torch.Tensor:
        """(B,) bool: the rows that end an episode (every row, unless an episode was forked)."""
        if not self.episodes:
            return torch.ones(len(self), dtype=torch.bool)
        return torch.tensor([t is not None for t in self.episodes], dtype=torch.bool)

    @staticmethod
    def from_chunk(ep: "Episodes", scored: "Scored", rewards: Sequence["Reward"], prompts: list[str],
                   metadata: list[dict[str, Any]], global_index: list[int], group_size: int = 1) -> "Rollouts":
        if ep.row_episode:
            return _from_episode_rows(ep, scored, rewards, prompts, metadata, global_index, group_size)
        T = ep.response_ids.shape[1]
        # the engine's log-probs are kept apart when the trainer computed its own (`forward`)
        engine_lp = ep.logprobs if ep.logprobs is not None and scored.logprobs is not ep.logprobs else None
        dense = None
        if any(rw.dense is not None for rw in rewards):
            dense = torch.zeros(len(rewards), T)  # (B, T)
            for i, rw in enumerate(rewards):
                if rw.dense is not None:
                    dense[i, : len(rw.dense)] = torch.tensor(rw.dense)
        return Rollouts(
            query_ids=ep.query_ids, query_mask=ep.query_mask, response_ids=ep.response_ids,
            response_mask=ep.response_mask, action_mask=ep.action_mask, logprobs=scored.logprobs,
            ref_logprobs=scored.ref_logprobs, values=scored.values,
            scores=torch.tensor([rw.score for rw in rewards], dtype=torch.float32),
            dense_scores=dense, prompts=list(prompts), outputs=list(ep.outputs), metadata=list(metadata),
            global_index=list(global_index), group=[i // group_size for i in global_index],
            reward_components=[rw.components for rw in rewards], engine_logprobs=engine_lp,
            versions=[ep.version] * len(rewards), truncated=list(ep.truncated),
            scorable=(None if all(rw.scorable for rw in rewards)
                      else torch.tensor([rw.scorable for rw in rewards], dtype=torch.bool)),
        )

    @staticmethod
    def concat(parts: Sequence["Rollouts"], pad_id: int) -> "Rollouts":
        """Merge chunks: queries re-aligned on the left, per-token tensors widened on the right."""
        if not parts:
            raise ValueError("Rollouts.concat needs at least one part")
        Q = max(p.query_ids.shape[1] for p in parts)
        T = max(p.response_ids.shape[1] for p in parts)

        def left(x: torch.Tensor, value: Any) -> torch.Tensor:
            return F.pad(x, (Q - x.shape[1], 0), value=value)

        def right(x: torch.Tensor, value: Any = 0) -> torch.Tensor:
            return F.pad(x, (0, T - x.shape[1]), value=value)

        dense = None
        if any(p.dense_scores is not None for p in parts):
            dense = torch.cat([right(p.dense_scores) if p.dense_scores is not None else torch.zeros(len(p), T)
                               for p in parts])

        def optional(get: Any) -> torch.Tensor | None:  # absent in every part (same models) or in none
            return None if get(parts[0]) is None else torch.cat([right(get(p)) for p in parts])

        def joined(get: Any) -> list[Any]:
            return [x for p in parts for x in get(p)]

        def flags(name: str) -> list[bool]:  # unset in every part stays unset
            return [] if not any(getattr(p, name) for p in parts) else [x for p in parts for x in p.flags(name).tolist()]

        return Rollouts(
            query_ids=torch.cat([left(p.query_ids, pad_id) for p in parts]),
            query_mask=torch.cat([left(p.query_mask, False) for p in parts]),
            response_ids=torch.cat([right(p.response_ids, pad_id) for p in parts]),
            response_mask=torch.cat([right(p.response_mask, False) for p in parts]),
            action_mask=torch.cat([right(p.action_mask, False) for p in parts]),
            logprobs=torch.cat([right(p.logprobs) for p in parts]),
            ref_logprobs=optional(lambda p: p.ref_logprobs), values=optional(lambda p: p.values),
            scores=torch.cat([p.scores for p in parts]), dense_scores=dense,
            prompts=joined(lambda p: p.prompts), outputs=joined(lambda p: p.outputs),
            metadata=joined(lambda p: p.metadata), global_index=joined(lambda p: p.global_index),
            group=joined(lambda p: p.group), reward_components=joined(lambda p: p.reward_components),
            segment=joined(lambda p: p.segment), episodes=joined(lambda p: p.episodes),
            engine_logprobs=optional(lambda p: p.engine_logprobs), versions=joined(lambda p: p.versions),
            scorable=(None if all(p.scorable is None for p in parts) else torch.cat(
                [p.scorable if p.scorable is not None else torch.ones(len(p), dtype=torch.bool) for p in parts])),
            truncated=flags("truncated"), filler=flags("filler"),
        )


def _from_episode_rows(ep: "Episodes", scored: "Scored", rewards: Sequence["Reward"], prompts: list[str],
                       metadata: list[dict[str, Any]], global_index: list[int], group_size: int) -> Rollouts:
    """``Rollouts.from_chunk`` for multi-turn episodes: one reward per EPISODE, rows per episode (more than
    one after a fork). The episode's score (+ the environment's summed rewards, ``env.turn_rewards: sum``)
    goes on its last row; a dense reward (aligned to the episode's response tokens, all rows in order) is
    cut into the rows; per-turn environment rewards are already placed (``ep.env_dense``)."""
    B, T = ep.response_ids.shape
    k = ep.row_episode
    # a separate engine's (vLLM) log-probs per row, 0 on environment tokens, kept beside the trainer's
    engine_lp = ep.logprobs if ep.logprobs is not None and scored.logprobs is not ep.logprobs else None
    last = [i == B - 1 or k[i + 1] != k[i] for i in range(B)]
    segment: list[int] = []
    for i in range(B):
        segment.append(segment[-1] + 1 if i and k[i - 1] == k[i] else 0)
    env_sum = ep.env_scores or [0.0] * len(rewards)
    scores = [rewards[k[i]].score + env_sum[k[i]] if last[i] else 0.0 for i in range(B)]
    lengths = ep.response_mask.sum(1).tolist()
    dense = ep.env_dense.clone() if ep.env_dense is not None else None
    if any(rw.dense is not None for rw in rewards):
        dense = dense if dense is not None else torch.zeros(B, T)  # (B, T)
        offset = 0
        for i in range(B):
            offset = 0 if segment[i] == 0 else offset
            d = rewards[k[i]].dense
            if d is not None:
                part = d[offset : offset + lengths[i]]
                dense[i, : len(part)] += torch.tensor(part)
            offset += lengths[i]
    return Rollouts(
        query_ids=ep.query_ids, query_mask=ep.query_mask, response_ids=ep.response_ids,
        response_mask=ep.response_mask, action_mask=ep.action_mask, logprobs=scored.logprobs,
        ref_logprobs=scored.ref_logprobs, values=scored.values,
        scores=torch.tensor(scores, dtype=torch.float64).float(), dense_scores=dense,
        prompts=[prompts[e] for e in k], outputs=[ep.outputs[e] for e in k], metadata=[metadata[e] for e in k],
        global_index=[global_index[e] for e in k], group=[global_index[e] // group_size for e in k],
        reward_components=[rewards[e].components if last[i] else {} for i, e in enumerate(k)],
        segment=segment, episodes=[ep.transcripts[e] if last[i] else None for i, e in enumerate(k)],
        # an episode without a reward (every function returned None): each of its rows
        scorable=(None if all(rw.scorable for rw in rewards)
                  else torch.tensor([rewards[e].scorable for e in k], dtype=torch.bool)),
        engine_logprobs=engine_lp, versions=[ep.version] * B,
    )


@dataclass
class Advantages:
    """What the update needs besides the rollouts, from one estimator (``ppo.estimator``)."""

    advantages: torch.Tensor  # (B, T) per token; critic-free: the sequence's advantage on each action token
    returns: torch.Tensor | None  # (B, T) value targets (`gae`); None without a value head
    seq_kl: torch.Tensor | None  # (B,) k1 KL to the reference per sequence; None without a reference
    loss_mask: torch.Tensor  # (B, T) bool: the tokens in the loss and its normaliser (the action mask minus
    #                          the groups `ppo.drop_zero_std_groups` leaves out)
    seq_advantages: list[float] = field(default_factory=list)  # (B,) per sequence, for rollouts.jsonl
    stats: dict[str, float] = field(default_factory=dict)  # estimator metrics, the same on every rank


@dataclass(frozen=True)
class Shard:
    """This rank's part of a batch: its global sample indices (rank-major order), the global index of
    its first sample, and the chunk rounds EVERY rank runs (so each enters the reward step as often)."""

    indices: list[int]
    first_index: int
    rounds: int
    chunk_size: int
    group_size: int = 1  # rollout.samples_per_prompt: global sample i is a member of group i // group_size

    @staticmethod
    def of_plan(plan: BatchPlan, rank: int, global_indices: list[int]) -> "Shard":
        off = plan.offset(rank)
        return Shard(global_indices[off : off + plan.local_count(rank)], off, plan.rounds, plan.chunk_size,
                     plan.samples_per_prompt)

    @staticmethod
    def even(n: int, world_size: int, rank: int, chunk_size: int) -> "Shard":
        """``n`` samples (e.g. the eval set) split as evenly as possible."""
        counts = split_evenly(n, world_size)
        off = sum(counts[:rank])
        return Shard(list(range(off, off + counts[rank])), off, -(-max(counts) // chunk_size), chunk_size)

    def round(self, r: int) -> list[int]:
        """The global indices of chunk round ``r`` on this rank (may be empty on some ranks)."""
        return self.indices[r * self.chunk_size : (r + 1) * self.chunk_size]
