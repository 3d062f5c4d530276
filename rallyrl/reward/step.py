"""The central reward step: gather every rank's samples, score them in batched calls, scatter back.

Placements (``reward.placement``):

- ``main``: samples are gathered to rank 0 (with per-rank counts, which may differ and may be 0), the
  reward functions run there once per chunk round (or in micro-batches of ``reward.batch_size``), the
  output is validated and each rank receives exactly its own rewards. Only rank 0 ever calls the reward
  function, so only rank 0 ever loads a reward model.
- ``local``: each rank scores its own samples.
- ``collective``: every rank receives the full gathered batch and calls the reward function together
  (for reward models sharded over the ranks, whose forward is itself a collective); each keeps its slice.

Every call runs inside ``isolated_rng()``, and failure is collective: whatever goes wrong on whichever
rank, every rank raises the same ``RewardError`` carrying the original message and traceback, right after
the step's next collective, instead of leaving peers blocked until a timeout.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import dist
from ..seeding import isolated_rng
from .validate import RewardValidationError, validate_rewards

RewardFn = Callable[..., Any]


class RewardError(RuntimeError):
    """A reward function failed or returned invalid output (raised identically on every rank)."""


@dataclass
class NamedRewardFn:
    name: str
    fn: RewardFn
    weight: float = 1.0


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
    optional dense per-token part aligned to the output tokens."""

    score: float
    dense: list[float] | None = None
    components: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return self.score + (sum(self.dense) if self.dense else 0.0)


@dataclass
class StepStats:
    """This rank's share of a step's statistics; SUMMED over ranks they give the global values (the
    trainer reduces them once per iteration with its other statistics, no extra collective here)."""

    calls: int = 0  # reward-function calls this rank made (a joint `collective` call counts once)
    samples: int = 0  # samples this rank scored
    time_reward: float = 0.0  # seconds this rank spent inside reward functions
    time_gather: float = 0.0  # seconds moving samples and rewards between ranks (not summed: per rank)


def call_kwargs(samples: Samples, tokenizer: Any) -> dict[str, Any]:
    """trlx-compatible keyword arguments: every metadata column as a per-sample list (None where a
    sample lacks it), plus ``output_token_ids`` and ``tokenizer``."""
    cols: dict[str, None] = {}
    for m in samples.metadata:
        cols.update(dict.fromkeys(m))
    kwargs: dict[str, Any] = {c: [m.get(c) for m in samples.metadata] for c in cols}
    kwargs["output_token_ids"] = samples.output_token_ids
    kwargs["tokenizer"] = tokenizer
    return kwargs


def score_samples(
    fns: Sequence[NamedRewardFn], samples: Samples, tokenizer: Any, batch_size: int | None, offset: int = 0
) -> tuple[list[Reward], int, float]:
    """Call every reward function on ``samples`` in micro-batches; validate; combine with weights.

    Returns (rewards, number of calls, seconds spent in the functions). Raises on any failure.
    """
    n = len(samples)
    if n == 0:
        return [], 0, 0.0
    bs = batch_size or n
    rewards = [Reward(0.0) for _ in range(n)]
    calls, t_total = 0, 0.0
    for nf in fns:
        for a in range(0, n, bs):
            part = samples.slice(a, min(n, a + bs))
            full = [p + o for p, o in zip(part.prompts, part.outputs)]
            t0 = time.perf_counter()
            with isolated_rng():
                out = nf.fn(full, part.prompts, part.outputs, **call_kwargs(part, tokenizer))
            t_total += time.perf_counter() - t0
            calls += 1
            lengths = [len(t) for t in part.output_token_ids]
            checked = validate_rewards(out, lengths, fn_name=f"reward function {nf.name!r}", offset=offset + a)
            for i, r in enumerate(checked):
                rw = rewards[a + i]
                if isinstance(r, list):
                    dense = rw.dense if rw.dense is not None else [0.0] * lengths[i]
                    for t, x in enumerate(r):
                        dense[t] += nf.weight * x
                    rw.dense = dense
                    rw.components[nf.name] = sum(r)
                else:
                    rw.score += nf.weight * r
                    rw.components[nf.name] = r
    return rewards, calls, t_total


def _failure(exc: BaseException, rank: int) -> str:
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return f"on rank {rank}: {type(exc).__name__}: {exc}\n{tb}"


def _raise_if_failed(failures: Sequence[str | None]) -> None:
    msgs = [m for m in failures if m]
    if msgs:
        raise RewardError("reward step failed " + msgs[0])


class RewardStep:
    """Callable object: ``step(local_samples) -> (local_rewards, StepStats)``; a collective call."""

    def __init__(
        self,
        fns: Sequence[NamedRewardFn],
        placement: str = "main",
        batch_size: int | None = None,
        tokenizer: Any = None,
    ) -> None:
        if placement not in ("main", "local", "collective"):
            raise ValueError(f"reward.placement must be main, local or collective, got {placement!r}")
        if not fns:
            raise ValueError("RewardStep needs at least one reward function")
        self.fns, self.placement, self.batch_size, self.tokenizer = list(fns), placement, batch_size, tokenizer

    def __call__(self, samples: Samples) -> tuple[list[Reward], StepStats]:
        if self.placement == "main":
            return self._main(samples)
        if self.placement == "local":
            return self._local(samples)
        return self._collective(samples)

    # --- main: gather -> score on rank 0 -> scatter --------------------------------------------
    def _main(self, samples: Samples) -> tuple[list[Reward], StepStats]:
        stats = StepStats()
        t0 = time.perf_counter()
        gathered = dist.gather_objects(samples, dst=0)
        stats.time_gather += time.perf_counter() - t0
        payload: list[Any] | None = None
        if dist.is_main():
            assert gathered is not None
            counts = [len(s) for s in gathered]
            try:
                rewards, stats.calls, stats.time_reward = score_samples(
                    self.fns, Samples.concat(gathered), self.tokenizer, self.batch_size
                )
                bounds = [sum(counts[:r]) for r in range(len(counts) + 1)]
                payload = [("ok", rewards[bounds[r] : bounds[r + 1]]) for r in range(len(counts))]
            except Exception as e:  # every failure is reported to every rank, then re-raised there
                payload = [("error", _failure(e, 0))] * len(counts)
            stats.samples = sum(counts)
        t1 = time.perf_counter()
        status, mine = dist.scatter_objects(payload, src=0)
        stats.time_gather += time.perf_counter() - t1
        if status == "error":
            raise RewardError("reward step failed " + mine)
        return mine, stats

    # --- local: each rank scores its own ---------------------------------------------------------
    def _local(self, samples: Samples) -> tuple[list[Reward], StepStats]:
        stats = StepStats()
        failure: str | None = None
        rewards: list[Reward] = []
        try:
            rewards, stats.calls, stats.time_reward = score_samples(
                self.fns, samples, self.tokenizer, self.batch_size
            )
        except Exception as e:
            failure = _failure(e, dist.rank())
        t0 = time.perf_counter()
        failures = dist.all_gather_objects(failure)
        stats.time_gather += time.perf_counter() - t0
        _raise_if_failed(failures)
        stats.samples = len(samples)
        return rewards, stats

    # --- collective: everyone scores the full batch together -------------------------------------
    def _collective(self, samples: Samples) -> tuple[list[Reward], StepStats]:
        stats = StepStats()
        t0 = time.perf_counter()
        gathered = dist.all_gather_objects(samples)
        stats.time_gather += time.perf_counter() - t0
        counts = [len(s) for s in gathered]
        offset = sum(counts[: dist.rank()])
        failure: str | None = None
        rewards: list[Reward] = []
        try:
            allr, stats.calls, stats.time_reward = score_samples(
                self.fns, Samples.concat(gathered), self.tokenizer, self.batch_size
            )
            rewards = allr[offset : offset + len(samples)]
        except Exception as e:
            failure = _failure(e, dist.rank())
        failures = dist.all_gather_objects(failure)
        _raise_if_failed(failures)
        if dist.rank() != 0:  # one joint call: count it once (stats are summed over ranks)
            stats.calls, stats.time_reward = 0, 0.0
        else:
            stats.samples = sum(counts)
        return rewards, stats
