"""The central reward step: gather every rank's samples, score them in batched calls, scatter back.

Placements (``reward.placement``):

- ``main``: samples are gathered to rank 0 (with per-rank counts, which may differ and may be 0), the
  reward functions run there once per chunk round (or in micro-batches of ``reward.batch_size``), the
  output is validated and each rank receives exactly its own rewards. Only rank 0 ever calls the reward
  function, so only rank 0 ever loads a reward model.
- ``local``: each rank scores its own samples.
- ``collective``: every rank receives the full gathered batch and calls the reward function together
  (for reward models sharded over the ranks, whose forward is itself a collective); each keeps its slice.

Every call runs inside ``isolated_rng()``, and failure is collective: whatever goes wrong in a reward
function on whichever rank, every rank raises the same ``RewardError`` carrying the original message and
traceback, right after the step's next collective, instead of leaving peers blocked until a timeout.

The ordering logic (global batch = rank-major concatenation of the shards; each rank's slice of it;
micro-batch bounds) is a set of pure functions in ``samples.py`` (``concat_shards``, ``split_by_counts``,
``micro_batches``) so it is tested without processes; the reward calls are ``scoring.py``'s
``score_samples``; the collectives are in ``rallyrl.dist``. This module is the step itself; the names
of the other two stay importable from here.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ContextManager

from .. import dist
from ..errors import Failure, RewardError
from .samples import (NamedRewardFn, Reward, RewardFn, Samples, StepStats, concat_shards, micro_batches,
                      split_by_counts)
from .scoring import RewardTimeoutError, call_kwargs, score_samples

# `seeding` (torch) is imported where it is used, not here: `import rallyrl` (and so the `rallyrl train
# --nproc N` launcher process, and `rallyrl check`) stays free of torch. (`dist` imports torch lazily.)

__all__ = ["PLACEMENTS", "Failure", "NamedRewardFn", "Reward", "RewardError", "RewardFn", "RewardHandle",
           "RewardStep", "RewardTimeoutError", "Samples", "StepStats", "call_kwargs", "concat_shards",
           "micro_batches", "score_samples", "split_by_counts"]

PLACEMENTS = ("main", "local", "collective")


def _no_notice(what: str) -> ContextManager[None]:
    return contextlib.nullcontext()


class RewardStep:
    """Callable object: ``step(local_samples) -> (local_rewards, StepStats)``; a collective call that
    every rank enters once per chunk round (also with 0 samples).

    The rollout loop uses ``submit(samples)`` per round and ``collect(handles)`` once after the last
    round: synchronous by default (``submit`` is the call above), or, with ``overlap=True``, ``submit``
    returns at once while the main rank's background thread scores the round, and ``collect`` waits
    and scatters every round's rewards in one collective. The results are the same either way.

    ``server``: a ``LocalRewardServer`` (``reward.server: local``) that ``open()`` starts on the main
    rank; the reward functions then become a ``RemoteReward`` pointed at it. ``close()`` stops it.
    ``notice(what)``: a context manager the main rank holds while it is blocked waiting for rewards
    (the trainer's progress line says so when that takes long, see ``RunLog.waiting``).
    """

    def __init__(
        self,
        fns: Sequence[NamedRewardFn],
        placement: str = "main",
        batch_size: int | None = None,
        tokenizer: Any = None,
        timeout_s: float | None = None,
        overlap: bool = False,
        server: Any = None,
        remote_options: dict[str, Any] | None = None,
        notice: Callable[[str], ContextManager[None]] = _no_notice,
    ) -> None:
        if placement not in PLACEMENTS:
            raise ValueError(f"reward.placement must be main, local or collective, got {placement!r}")
        if not fns:
            raise ValueError("RewardStep needs at least one reward function")
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"reward.batch_size must be > 0, got {batch_size}")
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"reward.timeout_s must be > 0, got {timeout_s}")
        if overlap and placement != "main":
            raise ValueError(f"reward overlap (submit/collect) needs placement 'main', not {placement!r}")
        if server is not None and placement != "main":
            raise ValueError(f"reward.server: local needs placement 'main', not {placement!r}")
        self.fns, self.placement, self.batch_size, self.tokenizer = list(fns), placement, batch_size, tokenizer
        self.timeout_s = timeout_s  # bounds each in-process reward call (None: unbounded)
        self.overlap, self.server, self.notice = overlap, server, notice
        self.remote_options = dict(remote_options or {})  # RemoteReward options for the local server
        self._executor: Any = None
        self._opened = server is None
        if overlap and self._opened:
            self._check_overlap()

    def launch_server(self) -> None:
        """Main rank, ``reward.server: local``: spawn the server process now, without waiting for it, so
        that it starts up while the caller loads models; ``open()`` later waits for it (and reports a
        failed start on every rank). Not a collective; nothing to do without a local server."""
        if self.server is not None and not self._opened and dist.is_main():
            try:
                self.server.launch()
            except OSError:
                pass  # open() starts it again and reports the failure collectively

    def open(self) -> None:
        """Start what the step needs before its first call; a collective (every rank calls it). With a
        local server: the main rank starts it (a start failure is the same ``RewardError`` on every
        rank, with the server's output), every rank learns its URL, and the reward functions become a
        ``RemoteReward`` pointed at it (only the main rank ever calls it with ``main`` placement)."""
        from ..seeding import isolated_rng
        from .client import RemoteReward

        if self._opened:
            return
        self._opened = True

        def start() -> str:
            with isolated_rng():  # nothing here may move the training RNG streams
                return self.server.start()

        url = dist.agree(start, RewardError, main_only=True, what="starting the reward server (reward.server: local)")
        remote = RemoteReward(url, **self.remote_options)
        self.fns = [NamedRewardFn(nf.name, remote, nf.weight) for nf in self.fns]
        if self.overlap:
            self._check_overlap()

    def __call__(self, samples: Samples) -> tuple[list[Reward], StepStats]:
        """Synchronous: gather, score, validate, scatter (one chunk round)."""
        self.open()
        if self.placement == "main":
            return self._main(samples)
        if self.placement == "local":
            return self._local(samples)
        return self._collective(samples)

    def _what(self) -> str:
        """What the main rank is waiting for, in the progress line's words."""
        from .client import RemoteReward

        remote = [nf.fn for nf in self.fns if isinstance(nf.fn, RemoteReward)]
        where = f" (server {remote[0].urls[0].rsplit('/', 1)[0]})" if remote else ""
        if self.placement == "main":
            return f"waiting for the reward on rank 0{where}"
        return f"waiting for the rewards ({self.placement} placement: every rank's call){where}"

    def _score(self, samples: Samples) -> tuple[list[Reward], StepStats]:
        """Every reward function on ``samples`` (this rank's call); ``time_wait`` is the whole call."""
        rewards, stats = score_samples(self.fns, samples, self.tokenizer, self.batch_size, timeout_s=self.timeout_s)
        stats.time_wait = stats.time_reward
        return rewards, stats

    def _agreed(self, score: Callable[[], tuple[list[Reward], StepStats]]) -> tuple[list[Reward], StepStats]:
        """``score()`` on every rank through ``dist.agree``: one exchange of the ranks' failures, so a
        failure on one rank reaches the others at once (the same ``RewardError`` everywhere) instead of
        leaving them waiting in the next collective; every rank takes part even on success. The
        exchange is this rank's ``time_gather``; the main rank's wait notice covers the call and it."""
        exchange: list[float] = []
        with self.notice(self._what()):
            rewards, stats = dist.agree(score, RewardError, on_exchange=exchange.append)
        stats.time_gather = exchange[0]
        return rewards, stats

    # --- main: gather -> score on rank 0 -> scatter --------------------------------------------
    # Not through dist.agree: its main-only form broadcasts ONE value to every rank, while here each
    # rank receives only its own rewards. The outcome (rewards or the failure) travels in the one
    # scatter the step needs anyway, so a failure costs no extra collective.
    def _main(self, samples: Samples) -> tuple[list[Reward], StepStats]:
        t0 = time.perf_counter()
        gathered = dist.gather_objects(samples, dst=0)
        t_gather = time.perf_counter() - t0
        stats = StepStats()
        payload: list[Any] | None = None
        if dist.is_main():
            assert gathered is not None
            batch, counts = concat_shards(gathered)
            try:
                with self.notice(self._what()):
                    rewards, stats = self._score(batch)
                payload = [("ok", mine) for mine in split_by_counts(rewards, counts)]
            except Exception as e:  # every failure is reported to every rank, then raised there
                payload = [("error", self._main_failure(e))] * len(counts)
        t1 = time.perf_counter()
        status, mine = dist.scatter_objects(payload, src=0)
        stats.time_gather = t_gather + time.perf_counter() - t1
        if status == "error":
            dist.raise_failures([mine], RewardError)
        return mine, stats

    # --- local: each rank scores its own ---------------------------------------------------------
    def _local(self, samples: Samples) -> tuple[list[Reward], StepStats]:
        return self._agreed(lambda: self._score(samples))

    # --- collective: everyone scores the full batch together -------------------------------------
    def _collective(self, samples: Samples) -> tuple[list[Reward], StepStats]:
        t0 = time.perf_counter()
        batch, counts = concat_shards(dist.all_gather_objects(samples))
        t_gather = time.perf_counter() - t0

        def score() -> tuple[list[Reward], StepStats]:
            everyone, stats = self._score(batch)
            return split_by_counts(everyone, counts)[dist.rank()], stats

        rewards, stats = self._agreed(score)
        stats.time_gather += t_gather
        if dist.rank() != 0:  # one joint call per micro-batch: count it once (stats are summed over ranks)
            stats.calls, stats.samples, stats.time_reward = 0, 0, 0.0
        return rewards, stats

    # --- the rollout loop's API: submit each round, collect once ---------------------------------
    def submit(self, samples: Samples) -> "RewardHandle":
        """Score one chunk round (a collective: every rank calls it every round).

        Synchronous (``overlap=False``): the step itself, run now; its result (or its ``RewardError``)
        comes at once. With ``overlap=True`` the samples are gathered to the main rank (the only
        blocking part), which hands the batch to a background thread and returns; every rank goes on
        generating. ``collect`` waits for the results, validates them and scatters them. Only with
        ``main`` placement and reward functions that never touch the global RNG (``RemoteReward``):
        the background call cannot run inside ``isolated_rng()`` (see ``score_samples``).
        """
        self.open()
        if not self.overlap:
            rewards, stats = self(samples)
            return RewardHandle(len(samples), result=(rewards, stats))
        t0 = time.perf_counter()
        gathered = dist.gather_objects(samples, dst=0)
        handle = RewardHandle(len(samples), time_gather=time.perf_counter() - t0)
        if dist.is_main():
            assert gathered is not None
            batch, handle.counts = concat_shards(gathered)
            handle.future = self._pool().submit(score_samples, self.fns, batch, self.tokenizer, self.batch_size,
                                                0, False)
        return handle

    def collect(self, handles: Sequence["RewardHandle"]) -> list[tuple[list[Reward], StepStats]]:
        """The ``(rewards, stats)`` of every submitted round, in order. With overlap: wait for every
        round, validate, and scatter ONCE; a failure in any round raises the same ``RewardError``
        (with its cause) on every rank. ``time_wait`` (on the last round's stats) is the time the main
        rank was blocked here."""
        handles = list(handles)
        if not self.overlap:
            assert all(h.result is not None for h in handles), "collect() takes the handles of submit()"
            return [h.result for h in handles]  # type: ignore[misc]
        stats = [StepStats(time_gather=h.time_gather) for h in handles]
        payload: list[Any] | None = None
        t_wait = 0.0
        if dist.is_main():
            t0 = time.perf_counter()
            per_rank: list[list[list[Reward]]] = [[] for _ in range(dist.world_size())]
            failure: Failure | None = None
            with self.notice(self._what()):
                for h, st in zip(handles, stats):
                    assert h.future is not None and h.counts is not None, "collect() takes the handles of submit()"
                    try:
                        rewards, s = h.future.result()
                    except Exception as e:  # keep waiting for the others: no thread is left running on exit
                        failure = failure or self._main_failure(e)
                        continue
                    st.calls, st.samples, st.time_reward = s.calls, s.samples, s.time_reward
                    for r, mine in enumerate(split_by_counts(rewards, h.counts)):
                        per_rank[r].append(mine)
            t_wait = time.perf_counter() - t0
            payload = ([("error", failure)] * len(per_rank) if failure is not None
                       else [("ok", mine) for mine in per_rank])
        t1 = time.perf_counter()
        status, mine = dist.scatter_objects(payload, src=0)
        if stats:
            stats[-1].time_gather += time.perf_counter() - t1
            stats[-1].time_wait = t_wait
        if status == "error":
            raise RewardError.from_failures([mine])
        assert len(mine) == len(handles) and all(len(m) == h.n for m, h in zip(mine, handles))
        return list(zip(mine, stats))

    def _main_failure(self, e: Exception) -> Failure:
        """The main rank's failure report; if the ``reward.server: local`` process has died, that is the
        cause the user needs (the client only saw a refused connection): its exit code and last output."""
        import dataclasses

        f = Failure.of(e, 0)
        proc = self.server.proc if self.server is not None else None
        if proc is not None and proc.poll() is not None:
            f = dataclasses.replace(f, message=f"{f.message}\n(the reward.server: local process has exited with code "
                                               f"{proc.returncode}; its last output:\n{self.server.output_tail()})")
        return f

    def _check_overlap(self) -> None:
        from .client import RemoteReward

        if self.placement != "main":
            raise ValueError(f"reward overlap (submit/collect) needs placement 'main', not {self.placement!r}")
        local = [nf.name for nf in self.fns if not isinstance(nf.fn, RemoteReward)]
        if local:
            raise ValueError(f"reward overlap needs remote reward functions (RemoteReward); {local} run in this "
                             f"process, where a background call would race with generation on the global RNG")

    def _pool(self) -> Any:
        from concurrent.futures import ThreadPoolExecutor

        if self._executor is None:
            # Several rounds in flight at once: a batching server merges them into fewer calls.
            self._executor = ThreadPoolExecutor(8, thread_name_prefix="rallyrl-reward-overlap")
        return self._executor

    def close(self) -> None:
        """Stop the background threads of ``submit`` (rounds not started yet are dropped; one in flight
        ends on its own, bounded by the client's timeout) and the local server, if any. Idempotent."""
        ex, self._executor = self._executor, None
        if ex is not None:
            ex.shutdown(wait=False, cancel_futures=True)
        if self.server is not None:
            self.server.stop()


@dataclass
class RewardHandle:
    """One submitted chunk round (``RewardStep.submit``)."""

    n: int  # this rank's sample count in the round
    time_gather: float = 0.0
    counts: list[int] | None = None  # overlap, main rank: per-rank counts
    future: Any = None  # overlap, main rank: concurrent.futures.Future of score_samples
    result: tuple[list[Reward], StepStats] | None = None  # synchronous: the round's rewards and stats
