"""Dynamic batching for the reward server: concurrent requests merged into reward calls (see ``Batcher``)."""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from .samples import NamedRewardFn, Samples
from .scoring import score_samples


@dataclass
class BatcherStats:
    requests: int = 0
    samples: int = 0
    calls: int = 0  # reward-function calls (a merged batch larger than max_batch makes several)
    batches: int = 0  # merged batches
    errors: int = 0  # batches whose reward call failed


class Batcher:
    """Merges concurrent requests into reward calls of up to ``max_batch`` samples.

    ``submit(samples) -> Future`` (thread-safe) resolves to that request's rewards (a float, or a
    per-token list, per sample) or to the exception of the call its batch was in. A worker thread takes
    the oldest request, waits at most ``max_wait_ms`` for more (stopping early when ``max_batch`` is
    reached; a request that does not fit opens the next batch), scores the merged batch with
    ``score_samples`` (RNG isolation + validation, in calls of at most ``max_batch``) and hands each
    request its own slice, in order. ``batching=False``: one request per call (the baseline).
    """

    def __init__(self, fn: NamedRewardFn, max_batch: int = 256, max_wait_ms: float = 5.0,
                 batching: bool = True, tokenizer: Any = None) -> None:
        if max_batch < 1:
            raise ValueError(f"--max-batch must be >= 1, got {max_batch}")
        if max_wait_ms < 0:
            raise ValueError(f"--max-wait-ms must be >= 0, got {max_wait_ms}")
        self.fn, self.max_batch, self.max_wait_s, self.batching = fn, max_batch, max_wait_ms / 1000, batching
        self.tokenizer = tokenizer
        self.stats = BatcherStats()
        self._q: queue.Queue[tuple[Samples, Future] | None] = queue.Queue()
        self._next: tuple[Samples, Future] | None = None  # taken from the queue, did not fit its batch
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="rallyrl-reward-batcher", daemon=True)
                self._thread.start()

    def stop(self) -> None:
        with self._lock:
            t, self._thread = self._thread, None
        if t is not None:
            self._q.put(None)
            t.join(timeout=30)

    def submit(self, samples: Samples) -> Future:
        fut: Future = Future()
        if len(samples) == 0:
            fut.set_result([])
            return fut
        self.start()
        self._q.put((samples, fut))
        return fut

    def _take(self) -> list[tuple[Samples, Future]] | None:
        first, self._next = (self._next, None) if self._next is not None else (self._q.get(), None)
        if first is None:
            return None
        batch, n = [first], len(first[0])
        if not self.batching:
            return batch
        deadline = time.monotonic() + self.max_wait_s
        while n < self.max_batch:
            left = deadline - time.monotonic()
            try:
                item = self._q.get(timeout=left) if left > 0 else self._q.get_nowait()
            except queue.Empty:
                break
            if item is None:
                self._q.put(None)  # stop once this batch is scored
                break
            if n + len(item[0]) > self.max_batch:
                self._next = item
                break
            batch.append(item)
            n += len(item[0])
        return batch

    def _run(self) -> None:
        while (batch := self._take()) is not None:
            self._score(batch)

    def _score(self, batch: list[tuple[Samples, Future]]) -> None:
        merged = Samples.concat([r for r, _ in batch])
        try:
            rewards, st = score_samples([self.fn], merged, self.tokenizer, self.max_batch)
            # One function with weight 1: exactly its validated output (0.0 + 1.0 * x == x); None where
            # it returned None (unscorable: JSON null on the wire).
            out = [None if not rw.scorable else rw.dense if rw.dense is not None else rw.score for rw in rewards]
        except Exception as e:  # every request of the batch gets the error; the worker goes on
            self.stats.errors += 1
            for _, fut in batch:
                fut.set_exception(e)
            return
        self.stats.batches += 1
        self.stats.calls += st.calls
        self.stats.requests += len(batch)
        self.stats.samples += len(merged)
        a = 0
        for r, fut in batch:
            fut.set_result(out[a : a + len(r)])
            a += len(r)
