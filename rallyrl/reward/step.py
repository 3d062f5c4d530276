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
micro-batch bounds) is a set of pure functions (``concat_shards``, ``split_by_counts``,
``micro_batches``) so it is tested without processes; the collectives are in ``rallyrl.dist``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ContextManager, TypeVar

from ..errors import Failure, RewardError
from .validate import validate_rewards

# `dist` and `seeding` (torch) are imported where they are used, not here: `import rallyrl` (and so the
# `rallyrl train --nproc N` launcher process, and `rallyrl check`) stays free of torch.

RewardFn = Callable[..., Any]
T = TypeVar("T")

PLACEMENTS = ("main", "local", "collective")
_NO_LENGTH = 2**62  # see score_samples


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
    optional dense per-token part aligned to the output tokens. ``components`` holds each reward
    function's own (unweighted) value, dense parts summed, keyed by the function's name."""

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


# ------------------------------------------------------------------------------------------------
# Pure ordering logic (no collectives): tested directly, property-based


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


class RewardTimeoutError(TimeoutError):
    """An in-process reward call took longer than ``reward.timeout_s``."""


def _call_bounded(fn: RewardFn, args: tuple, kwargs: dict[str, Any], timeout_s: float, name: str) -> Any:
    """``fn(*args, **kwargs)`` inside ``isolated_rng()`` on a helper thread, waited for at most
    ``timeout_s``. The caller's thread only waits meanwhile, so the RNG save/restore cannot race with it;
    a call that overruns cannot be killed: it is left running (a daemon thread) and the run stops."""
    import threading

    import torch

    from ..seeding import isolated_rng

    # The current CUDA device is per thread: the helper uses the caller's (a rank's own GPU, not cuda:0).
    device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            if device is not None:
                torch.cuda.set_device(device)
            with isolated_rng():
                box["out"] = fn(*args, **kwargs)
        except BaseException as e:  # re-raised on the caller's thread
            box["error"] = e

    t = threading.Thread(target=run, name="rallyrl-reward-call", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise RewardTimeoutError(f"reward function {name!r} did not return within reward.timeout_s={timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box["out"]


def score_samples(
    fns: Sequence[NamedRewardFn], samples: Samples, tokenizer: Any, batch_size: int | None, offset: int = 0,
    isolate: bool = True, timeout_s: float | None = None,
) -> tuple[list[Reward], StepStats]:
    """Call every reward function on ``samples`` in micro-batches; validate; combine with weights.

    Every call runs inside ``isolated_rng()`` (``isolate=False`` only for the background calls of
    ``RewardStep.submit``: saving and restoring the global RNG state from a second thread would race
    with generation on the main thread, so only functions that never touch it, ``RemoteReward``, are
    run there). Returns the rewards (aligned with ``samples``) and the call statistics. Raises on any
    failure (the caller makes it collective). ``offset`` is the index of the first sample in the batch
    the user sees (for messages). ``timeout_s`` bounds each call of an in-process function (see
    ``_call_bounded``); a ``RemoteReward`` bounds its own HTTP attempts and retries, so it is not bounded
    again here.
    """
    import contextlib

    from ..seeding import isolated_rng
    from .client import RemoteReward

    n = len(samples)
    rewards = [Reward(0.0) for _ in range(n)]
    stats = StepStats()
    for nf in fns:
        for a, b in micro_batches(n, batch_size):
            part = samples.slice(a, b)
            full = [p + o for p, o in zip(part.prompts, part.outputs)]
            kwargs = call_kwargs(part, tokenizer)
            t0 = time.perf_counter()
            if timeout_s is not None and isolate and not isinstance(nf.fn, RemoteReward):
                out = _call_bounded(nf.fn, (full, part.prompts, part.outputs), kwargs, timeout_s, nf.name)
            else:
                with isolated_rng() if isolate else contextlib.nullcontext():
                    out = nf.fn(full, part.prompts, part.outputs, **kwargs)
            stats.time_reward += time.perf_counter() - t0
            stats.calls += 1
            stats.samples += b - a
            # None: token ids unknown (a server request without them); the dense length is then
            # checked on the client, which has them.
            lengths = [len(t) if t is not None else _NO_LENGTH for t in part.output_token_ids]
            checked = validate_rewards(out, lengths, fn_name=f"reward function {nf.name!r}", offset=offset + a)
            for i, r in enumerate(checked):
                rw = rewards[a + i]
                if isinstance(r, list):
                    n_tok = lengths[i] if lengths[i] != _NO_LENGTH else len(r)
                    dense = rw.dense if rw.dense is not None else [0.0] * n_tok
                    dense.extend([0.0] * (len(r) - len(dense)))  # unknown token count: as long as needed
                    for t, x in enumerate(r):
                        dense[t] += nf.weight * x
                    rw.dense = dense
                    rw.components[nf.name] = sum(r)
                else:
                    rw.score += nf.weight * r
                    rw.components[nf.name] = r
    return rewards, stats


# ------------------------------------------------------------------------------------------------
# The step


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
        from .. import dist

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
        from .. import dist
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

    # --- main: gather -> score on rank 0 -> scatter --------------------------------------------
    def _main(self, samples: Samples) -> tuple[list[Reward], StepStats]:
        from .. import dist

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
                    rewards, stats = score_samples(self.fns, batch, self.tokenizer, self.batch_size,
                                                   timeout_s=self.timeout_s)
                stats.time_wait = stats.time_reward
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
        from .. import dist

        failure: Failure | None = None
        rewards: list[Reward] = []
        stats = StepStats()
        with self.notice(self._what()):
            try:
                rewards, stats = score_samples(self.fns, samples, self.tokenizer, self.batch_size,
                                               timeout_s=self.timeout_s)
            except Exception as e:
                failure = Failure.of(e, dist.rank())
            stats.time_wait = stats.time_reward
            # Even on success every rank takes part in this exchange: that is what lets a failure on one
            # rank reach the others at once instead of leaving them waiting in the next collective.
            t0 = time.perf_counter()
            failures = dist.all_gather_objects(failure)
            stats.time_gather = time.perf_counter() - t0
        dist.raise_failures(failures, RewardError)
        return rewards, stats

    # --- collective: everyone scores the full batch together -------------------------------------
    def _collective(self, samples: Samples) -> tuple[list[Reward], StepStats]:
        from .. import dist

        t0 = time.perf_counter()
        batch, counts = concat_shards(dist.all_gather_objects(samples))
        t_gather = time.perf_counter() - t0
        failure: Failure | None = None
        rewards: list[Reward] = []
        stats = StepStats()
        with self.notice(self._what()):
            try:
                allr, stats = score_samples(self.fns, batch, self.tokenizer, self.batch_size,
                                            timeout_s=self.timeout_s)
                rewards = split_by_counts(allr, counts)[dist.rank()]
            except Exception as e:
                failure = Failure.of(e, dist.rank())
            stats.time_wait = stats.time_reward
            t1 = time.perf_counter()
            failures = dist.all_gather_objects(failure)
            stats.time_gather = t_gather + time.perf_counter() - t1
        dist.raise_failures(failures, RewardError)
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
        from .. import dist

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
        from .. import dist

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
