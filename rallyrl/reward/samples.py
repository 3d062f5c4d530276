"""What a reward step moves between ranks: ``Samples`` in, ``Reward`` out, ``StepStats`` about it, and the
pure ordering logic of the global batch (no collectives, no torch: tested directly, property-based).

The global batch of a chunk round is the rank-major concatenation of the ranks' shards (``concat_shards``,
the order of the global sample index); ``split_by_counts`` cuts results back into each rank's slice;
``micro_batches`` bounds the reward calls over a batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

RewardFn = Callable[..., Any]
T = TypeVar("T")


@dataclass
class NamedRewardFn:
    name: str
    fn: RewardFn
    weight: float = 1.0
    # How it is called: "trlx" or "trl" (reward/signature.py). None: read from its parameters at the
    # first call; a run sets it at start (`resolve_reward_fns`), so a bad signature fails before models load.
    signature: str | None = None


@dataclass
class Samples:
    """One rank's samples for a reward step (all lists aligned)."""

    prompts: list[str]
    outputs: list[str]
    output_token_ids: list[list[int]]
    metadata: list[dict[str, Any]]

    def __len__(self) -> int:
        return len(self.prompts)

    def slice(self, a: int, b: int) -> "Samples":
        return Samples(self.prompts[a:b], self.outputs[a:b], self.output_token_ids[a:b], self.metadata[a:b])

    @staticmethod
    def concat(parts: Sequence["Samples"]) -> "Samples":
        return Samples(
            [p for s in parts for p in s.prompts],
            [o for s in parts for o in s.outputs],
            [t for s in parts for t in s.output_token_ids],
            [m for s in parts for m in s.metadata],
        )


@dataclass
class Reward:
    """The combined reward of one sample: a scalar ``score`` (placed on the last output token) plus an
    optional dense per-token part aligned to the output tokens. ``components`` holds each reward
    function's own (unweighted) value, dense parts summed, keyed by the function's name; a function that
    returned None for the sample has no entry. ``scorable`` is False when EVERY function returned None:
    the sample has no reward (``score`` 0.0, never used: docs/reward.md, "None: unscorable")."""

    score: float
    dense: list[float] | None = None
    components: dict[str, float] = field(default_factory=dict)
    scorable: bool = True

    @property
    def total(self) -> float | None:
        """The scalar plus the dense rewards; None for an unscorable sample."""
        if not self.scorable:
            return None
        return self.score + (sum(self.dense) if self.dense else 0.0)


@dataclass
class StepStats:
    """This rank's share of a step's statistics; SUMMED over ranks they give the global values (the
    trainer reduces them once per iteration with its other statistics, no extra collective here)."""

    calls: int = 0  # reward-function calls this rank made (a joint `collective` call counts once)
    samples: int = 0  # samples passed to those calls (so samples / calls = mean micro-batch size)
    time_reward: float = 0.0  # seconds this rank spent inside reward functions
    time_gather: float = 0.0  # seconds moving samples, rewards and failures between ranks (per rank)
    # seconds this rank was BLOCKED waiting for rewards: its reward calls when synchronous; with overlap
    # (submit/collect) only the part that generation did not hide. With `main` placement 0 off rank 0.
    time_wait: float = 0.0

    def add(self, other: "StepStats") -> None:
        """Accumulate another step's statistics (the chunk rounds of one iteration)."""
        self.calls += other.calls
        self.samples += other.samples
        self.time_reward += other.time_reward
        self.time_gather += other.time_gather
        self.time_wait += other.time_wait


def concat_shards(shards: Sequence[Samples]) -> tuple[Samples, list[int]]:
    """The global batch of a chunk round: the ranks' shards concatenated in rank order (rank-major, the
    order of the global sample index), and the per-rank counts needed to split results back."""
    return Samples.concat(shards), [len(s) for s in shards]


def split_by_counts(items: Sequence[T], counts: Sequence[int]) -> list[list[T]]:
    """Inverse of the concatenation: ``items`` (one per global sample) cut into per-rank lists."""
    if sum(counts) != len(items) or any(c < 0 for c in counts):
        raise ValueError(f"cannot split {len(items)} items into per-rank counts {list(counts)}")
    out, a = [], 0
    for c in counts:
        out.append(list(items[a : a + c]))
        a += c
    return out


def micro_batches(n: int, batch_size: int | None) -> list[tuple[int, int]]:
    """[start, end) bounds of the reward calls over ``n`` samples (``None`` = one call with all)."""
    if n == 0:
        return []
    bs = batch_size or n
    return [(a, min(n, a + bs)) for a in range(0, n, bs)]
