"""Generation, stop-sequence truncation and the log-prob/value pass, producing ``Rollouts``.

Shapes: ``B`` samples on this rank, ``Q`` query length (left-padded), ``T`` response length
(right-padded), ``V`` vocab. ``response_mask`` is True for real response tokens (one mask convention).

We train on exactly the sampled token ids. The text handed to the reward function is the decoding of
those same ids; it is never re-tokenized for training (trlx re-tokenized decoded text, so its reward
model saw a different ending than the tokens that were trained on).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from . import dist, ops
from .config import BatchPlan, GenerationConfig, split_evenly
from .models import Policy, Reference
from .reward.step import Reward


@dataclass
class Generated:
    """Generation output of one chunk on one rank: padded once, here, and used as is downstream."""

    query_ids: torch.Tensor  # (B, Q) left-padded
    query_mask: torch.Tensor  # (B, Q) bool
    response_ids: torch.Tensor  # (B, T) right-padded; after EOS / stop truncation, EOS kept (an action)
    response_mask: torch.Tensor  # (B, T) bool
    response_lists: list[list[int]]  # the same response tokens, unpadded (what the reward function sees)
    outputs: list[str]  # decode(response) without special tokens
    # rollout.logprobs_from=generate: the policy's (B, T) log-probs and values from the decoding itself
    logprobs: torch.Tensor | None = None
    values: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.outputs)


@dataclass
class Scored:
    """The rollout-time forward passes over one chunk (response positions; 0 on padding)."""

    logprobs: torch.Tensor  # (B, T) of the sampling policy (temperature applied)
    ref_logprobs: torch.Tensor | None  # (B, T) of the frozen reference; None: no reference (beta 0)
    values: torch.Tensor | None  # (B, T); None: the policy has no value head (critic-free)


@dataclass
class Rollouts:
    """One rank's training batch for an iteration (tensors on CPU)."""

    query_ids: torch.Tensor  # (B, Q) left-padded with pad_id
    query_mask: torch.Tensor  # (B, Q) bool
    response_ids: torch.Tensor  # (B, T) right-padded with pad_id
    response_mask: torch.Tensor  # (B, T) bool
    logprobs: torch.Tensor  # (B, T) of the sampling policy (temperature applied)
    ref_logprobs: torch.Tensor | None  # (B, T) of the frozen reference; None without a reference
    values: torch.Tensor | None  # (B, T); None without a value head
    scores: torch.Tensor  # (B,) scalar reward, placed on the last real token
    dense_scores: torch.Tensor | None  # (B, T) per-token reward, or None when no sample has one
    prompts: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    metadata: list[dict[str, Any]] = field(default_factory=list)
    global_index: list[int] = field(default_factory=list)  # the sample's index in the iteration's global batch
    group: list[int] = field(default_factory=list)  # group id (= global_index // samples_per_prompt)
    reward_components: list[dict[str, float]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.prompts)

    def total_rewards(self) -> torch.Tensor:
        """(B,) each sample's whole reward: the scalar score plus its dense per-token rewards."""
        dense = self.dense_scores.sum(1).double() if self.dense_scores is not None else 0.0
        return self.scores.double() + dense  # float64: the logged value is the exact sum of the two parts

    @staticmethod
    def from_chunk(gen: Generated, scored: Scored, rewards: Sequence[Reward], prompts: list[str],
                   metadata: list[dict[str, Any]], global_index: list[int], group_size: int = 1) -> "Rollouts":
        T = gen.response_ids.shape[1]
        dense = None
        if any(rw.dense is not None for rw in rewards):
            dense = torch.zeros(len(rewards), T)  # (B, T)
            for i, rw in enumerate(rewards):
                if rw.dense is not None:
                    dense[i, : len(rw.dense)] = torch.tensor(rw.dense)
        return Rollouts(
            query_ids=gen.query_ids, query_mask=gen.query_mask, response_ids=gen.response_ids,
            response_mask=gen.response_mask, logprobs=scored.logprobs, ref_logprobs=scored.ref_logprobs,
            values=scored.values, scores=torch.tensor([rw.score for rw in rewards], dtype=torch.float32),
            dense_scores=dense, prompts=list(prompts), outputs=list(gen.outputs), metadata=list(metadata),
            global_index=list(global_index), group=[i // group_size for i in global_index],
            reward_components=[rw.components for rw in rewards],
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

        return Rollouts(
            query_ids=torch.cat([left(p.query_ids, pad_id) for p in parts]),
            query_mask=torch.cat([left(p.query_mask, False) for p in parts]),
            response_ids=torch.cat([right(p.response_ids, pad_id) for p in parts]),
            response_mask=torch.cat([right(p.response_mask, False) for p in parts]),
            logprobs=torch.cat([right(p.logprobs) for p in parts]),
            ref_logprobs=optional(lambda p: p.ref_logprobs),
            values=optional(lambda p: p.values),
            scores=torch.cat([p.scores for p in parts]),
            dense_scores=dense,
            prompts=[x for p in parts for x in p.prompts],
            outputs=[x for p in parts for x in p.outputs],
            metadata=[x for p in parts for x in p.metadata],
            global_index=[x for p in parts for x in p.global_index],
            group=[x for p in parts for x in p.group],
            reward_components=[x for p in parts for x in p.reward_components],
        )


@dataclass
class Advantages:
    """What the update needs besides the rollouts, from one estimator (``ppo.estimator``)."""

    advantages: torch.Tensor  # (B, T) per token; critic-free: the sequence's advantage on each response token
    returns: torch.Tensor | None  # (B, T) value targets (`gae`); None without a value head
    seq_kl: torch.Tensor | None  # (B,) k1 KL to the reference per sequence; None without a reference
    loss_mask: torch.Tensor  # (B, T) bool: the tokens in the loss and its normaliser (response_mask minus
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


def pad(seqs: list[list[int]], pad_id: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L) ids and mask; ``left`` for prompts (every response then starts at the same column),
    right for responses."""
    lens = [len(x) for x in seqs]
    width = max(lens, default=0)
    # One tensor from padded Python lists and a mask from the lengths: one torch call per batch, not two
    # per row (milliseconds per generation chunk; benchmarks/README.md, floors).
    rows = [[pad_id] * (width - n) + list(x) if left else list(x) + [pad_id] * (width - n) for x, n in zip(seqs, lens)]
    ids = torch.tensor(rows, dtype=torch.long).reshape(len(seqs), width)
    cols, n = torch.arange(width), torch.tensor(lens, dtype=torch.long).reshape(-1, 1)
    mask = cols >= width - n if left else cols < n  # (B, L)
    return ids, mask


def truncate_at_stop(ids: list[int], tokenizer: Any, stop_sequences: list[str]) -> list[int]:
    """Keep the shortest prefix whose decoding contains a stop sequence (the tokens completing it are
    kept: emitting the stop is what the policy should learn). Unchanged if no stop sequence occurs.

    "Prefix decoding contains a stop string" is monotone in the prefix length, so a binary search needs
    O(log T) decodes instead of T.
    """
    if not stop_sequences:
        return ids

    def has_stop(k: int) -> bool:
        text = tokenizer.decode(ids[:k], skip_special_tokens=True)
        return any(s in text for s in stop_sequences)

    if not has_stop(len(ids)):
        return ids
    lo, hi = 1, len(ids)  # has_stop(hi) is True
    while lo < hi:
        mid = (lo + hi) // 2
        if has_stop(mid):
            hi = mid
        else:
            lo = mid + 1
    return ids[:lo]


def prompt_index(query_ids: list[list[int]]) -> list[int] | None:
    """For each query, the index of the first query with the same tokens; None when no query repeats
    (then there is nothing to prefill once)."""
    first: dict[tuple[int, ...], int] = {}
    index = [first.setdefault(tuple(q), i) for i, q in enumerate(query_ids)]
    return index if len(first) < len(index) else None


@torch.no_grad()
def generate(policy: Policy, tokenizer: Any, query_ids: list[list[int]], gen: GenerationConfig, do_sample: bool,
             device: torch.device, scored: bool = False) -> Generated:
    """Sample responses for one chunk of prompts through ``policy.generate`` (KV cache on); with
    ``scored`` (``rollout.logprobs_from: generate``) through ``policy.generate_scored``, which also
    keeps the policy's log-probs and values of the sampled tokens, so ``score_tokens`` needs no
    policy forward. With ``gen.prefill_once`` a query repeated in the chunk (a group's G members) is
    prefilled once and its cache shared by its copies.

    Every rank calls it in every chunk round, with or without prompts: under FSDP the policy's weights
    are gathered once for the whole call (a collective), after which ranks decode independently for as
    many steps as their own samples need."""
    with dist.gathered(policy):
        if not query_ids:  # a rank with no sample in this chunk round still enters the reward step
            empty = torch.zeros(0, 0, dtype=torch.long)
            none = torch.zeros(0, 0) if scored else None
            return Generated(empty, empty.bool(), empty, empty.bool(), [], [], none, none)
        q, qm = pad(query_ids, tokenizer.pad_token_id, left=True)  # (B, Q)
        sampling: dict[str, Any] = dict(max_new_tokens=gen.max_new_tokens, do_sample=do_sample,
                                        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        if do_sample:
            sampling.update(temperature=gen.temperature, top_k=gen.top_k or None, top_p=gen.top_p)
        else:
            sampling.update(temperature=None, top_k=None, top_p=None)
        same = prompt_index(query_ids) if gen.prefill_once else None  # a group's G copies: one prefill
        if same is not None:
            sampling["prompt_index"] = torch.tensor(same, device=device)
        if scored:
            ids, step_lp, step_v = policy.generate_scored(q.to(device), qm.to(device), gen.temperature, **sampling)
        else:
            ids = policy.generate(q.to(device), qm.to(device), **sampling)  # (B, T')
        responses = ids.tolist()
    eos = tokenizer.eos_token_id
    kept: list[list[int]] = []
    for r in responses:
        if eos is not None and eos in r:
            # Keep EOS: choosing to stop is an action with a reward. What follows is generate()'s padding.
            r = r[: r.index(eos) + 1]
        r = truncate_at_stop(r, tokenizer, gen.stop_sequences)
        # (never empty: generate() samples at least one token, and both cuts keep at least one)
        kept.append(r or [eos if eos is not None else tokenizer.pad_token_id])
    r_ids, rm = pad(kept, tokenizer.pad_token_id, left=False)  # (B, T)
    outputs = [tokenizer.decode(r, skip_special_tokens=True) for r in kept]
    if not scored:
        return Generated(q, qm, r_ids, rm, kept, outputs)
    T = r_ids.shape[1]  # <= T': the cuts only shorten responses, token t stays at column t
    values = (step_v[:, :T] * rm).cpu() if step_v is not None else None
    return Generated(q, qm, r_ids, rm, kept, outputs, (step_lp[:, :T] * rm).cpu(), values)


@torch.no_grad()
def score_tokens(policy: Policy, reference: Reference | None, gen: Generated, temperature: float,
                 device: torch.device, from_generation: bool = False) -> Scored | None:
    """One forward of the policy (log-probs + values, if it has a value head) and one of the reference
    (log-probs; skipped when there is none); None for an empty chunk. With ``from_generation`` (``rollout.logprobs_from: generate``) the policy's part was
    kept by ``generate`` and only the reference runs. Every rank calls it in every chunk round: under
    FSDP each model is gathered in turn (one whole model at a time) around its forward, so a rank
    without samples still takes part (``from_generation`` comes from the config, the same on all ranks).
    A reference that runs the policy's own weights (``reads_policy``: the ``shared`` trunk, the ``lora``
    base) is gathered together with the policy instead, for both passes: its forward reads them."""
    q, qm = gen.query_ids.to(device), gen.query_mask.to(device)
    r, rm = gen.response_ids.to(device), gen.response_mask.to(device)
    if from_generation and gen.logprobs is None:
        raise ValueError("score_tokens(from_generation=True) needs generate(..., scored=True) output")
    logprobs = values = ref_lp = None

    def policy_pass() -> None:
        nonlocal logprobs, values
        if len(gen) and not from_generation:
            logits, values = policy(q, qm, r, rm)  # (B, T, V), (B, T)
            # Temperature is part of the sampling policy, so log-probs (and the KL) are of the scaled
            # logits, in the rollout pass and in training alike (as in TRL).
            logprobs = ops.logprobs_from_logits(logits.float() / temperature, r)  # (B, T)

    def reference_pass() -> None:
        nonlocal ref_lp
        if len(gen):
            ref_lp = reference.logprobs(q, qm, r, rm, temperature)  # (B, T)

    # Every choice below comes from the config (the same on every rank): no rank skips a collective.
    if reference is not None and reference.reads_policy:
        with dist.gathered(policy, reference):
            policy_pass()
            reference_pass()
    else:
        if not from_generation:
            with dist.gathered(policy):
                policy_pass()
        if reference is not None:
            with dist.gathered(reference):
                reference_pass()
    if not len(gen):
        return None
    ref = (ref_lp * rm).cpu() if ref_lp is not None else None
    if from_generation:  # generate() already masked them and put them on the CPU
        return Scored(logprobs=gen.logprobs, ref_logprobs=ref, values=gen.values)
    return Scored(logprobs=(logprobs * rm).cpu(), ref_logprobs=ref,
                  values=(values.float() * rm).cpu() if values is not None else None)
