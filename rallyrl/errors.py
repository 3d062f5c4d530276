"""Typed errors that every rank raises identically when a stage fails on some of them.

A stage that can fail on some ranks only (a reward function, ``metric_fn``, checkpoint I/O, a
non-finite update) runs through ``rallyrl.dist.agree``: the ranks exchange what went wrong, agree on
the first failure (lowest rank) and each raises the same error type with the same message, so no rank
is left waiting in a collective for a peer that has already given up.

This module imports nothing heavy (no torch): the CLI and ``import rallyrl`` use it.
"""

from __future__ import annotations

import signal
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn


@dataclass(frozen=True)
class Failure:
    """What went wrong on one rank (picklable: it is sent to every rank)."""

    rank: int
    error_type: str
    message: str
    traceback: str
    # True when the exception was itself a StageError: its message is already the full report (e.g.
    # "checkpoint X is incomplete: ..."), so it is re-raised as it was instead of wrapped again.
    is_report: bool = False

    @staticmethod
    def of(exc: BaseException, rank: int) -> "Failure":
        if isinstance(exc, StageError):
            return Failure(rank, type(exc).__name__, str(exc), exc.traceback_text or "", is_report=True)
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return Failure(rank, type(exc).__name__, str(exc), tb)

    def text(self) -> str:
        return f"on rank {self.rank}: {self.error_type}: {self.message}\n{self.traceback}"


class StageError(RuntimeError):
    """A stage failed on at least one rank; raised identically on every rank.

    ``rank``, ``error_type``, ``original_message`` and ``traceback_text`` describe the original failure
    (of the lowest failing rank when several failed; ``failed_ranks`` lists them all). Subclasses name
    the stage; the CLI prints ``rallyrl: <ClassName>: <message>``.
    """

    what = "stage"

    def __init__(self, message: str, failure: Failure | None = None, failed_ranks: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.rank = failure.rank if failure else None
        self.error_type = failure.error_type if failure else None
        self.original_message = failure.message if failure else None
        self.traceback_text = failure.traceback if failure else None
        self.failed_ranks = list(failed_ranks)

    @classmethod
    def from_failures(cls, failures: Sequence[Failure | None], what: str | None = None) -> "StageError":
        got = sorted((f for f in failures if f is not None), key=lambda f: f.rank)
        assert got, "from_failures needs at least one failure"
        first = got[0]
        msg = first.message if first.is_report else f"{what or cls.what} failed {first.text()}"
        if len(got) > 1:
            msg += f"\n(it also failed on rank(s) {', '.join(str(f.rank) for f in got[1:])})"
        return cls(msg, first, [f.rank for f in got])


class RewardError(StageError):
    """A reward function failed or returned invalid output."""

    what = "reward step"


class MetricError(StageError):
    """``metric_fn`` failed or returned something that is not ``{name: per-sample values}``."""

    what = "metric_fn"


class CheckpointError(StageError):
    """A checkpoint is missing, incomplete or corrupt, does not fit this run, or could not be written."""

    what = "checkpoint"


class NonFiniteError(StageError):
    """The loss or the gradient norm became NaN/inf; the step was not applied."""

    what = "update"


class CollectiveTimeoutError(RuntimeError):
    """A rank waited longer than ``dist.timeout_s`` in a collective: a peer is stuck or dead."""


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM seen by the CLI's handler, delivered like Ctrl-C so the trainer stops the same
    way; the exit code is 128 + the signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_signals_received: list[int] = []  # by this process's CLI handler (``rallyrl train``), newest last


def interrupt_received(signum: int, frame: Any = None) -> NoReturn:
    """The CLI's SIGINT/SIGTERM handler: remember the signal, then raise where the main thread is."""
    _signals_received.append(signum)
    raise Interrupted(signum)


def raise_if_interrupted() -> None:
    """Raise again for a signal whose KeyboardInterrupt never reached the trainer. Python runs a signal
    handler wherever the main thread is, a garbage-collection finalizer included, and an exception
    raised there is printed as "Exception ignored" and dropped: the run would go on as if no Ctrl-C
    had come. The training loop calls this once per iteration, so such a signal still stops the run
    within one iteration."""
    if _signals_received:
        raise Interrupted(_signals_received[-1])


def forget_interrupts() -> None:
    _signals_received.clear()


class TrackerError(StageError):
    """An experiment tracker of ``train.report_to`` could not start (on the main rank)."""

    what = "tracker"


class CallbackError(StageError):
    """A callback passed to ``rallyrl.train(callbacks=...)`` raised or returned something unexpected."""

    what = "callback"
