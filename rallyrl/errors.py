"""Typed errors that every rank raises identically when a stage fails on some of them.

A stage that can fail on some ranks only (a reward function, ``metric_fn``, checkpoint I/O, a
non-finite update) runs through ``rallyrl.dist.agree``: the ranks exchange what went wrong, agree on
the first failure (lowest rank) and each raises the same error type with the same message, so no rank
is left waiting in a collective for a peer that has already given up.

This module imports nothing heavy (no torch): the CLI and ``import rallyrl`` use it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import signal
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
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


class ModelWeightsError(StageError):
    """Rank 0 could not read the initial weights it sends every rank (``model.sharding: fsdp``, loading
    straight into shards): raised on every rank, instead of the others failing later with a broken
    connection."""

    what = "reading the model's weights"


class EpisodeError(StageError):
    """A multi-turn episode could not go on: an environment's ``reset`` / ``step`` raised or returned
    something invalid, a tool failed with ``env.on_tool_error: fail``, an environment call timed out, or
    the chat template is not prefix-preserving (``env.on_template_drift: fail``). The message names the
    prompt and the turn."""

    what = "environment"


class EngineError(StageError):
    """The generation engine (``generation.engine: vllm``) could not start, generate, take a weight push in
    time, or its probe after a push disagreed with the policy (it would sample from other weights)."""

    what = "generation engine"


class CollectiveTimeoutError(RuntimeError):
    """A rank waited longer than ``dist.timeout_s`` in a collective: a peer is stuck or dead."""


class RunDirWriteError(StageError):
    """rallyrl could not write its own run directory (a checkpoint, a log, ``final/``): a full disk, a
    quota, permissions, a read-only file system. Reported as one line (the path, the OS reason, a hint);
    the traceback is kept in ``traceback_text`` for ``RALLYRL_DEBUG=1``. Raised identically on every
    rank when the write ran through ``dist.agree`` (checkpoints, ``final/``)."""

    what = "writing the run directory"


# What to do about the OS reasons a write fails with most often; anything else gets the generic hint.
_SPACE = "free space on that file system (or raise the quota), or point train.run_dir to one with room"
_ACCESS = "make train.run_dir writable by this user, or choose another train.run_dir"
_IO_HINTS = {errno.ENOSPC: _SPACE, errno.EDQUOT: _SPACE, errno.EFBIG: _SPACE, errno.EACCES: _ACCESS,
             errno.EPERM: _ACCESS, errno.EROFS: "the file system is read-only: choose a writable train.run_dir"}


def os_error_of(exc: BaseException) -> OSError | None:
    """``exc`` as an ``OSError``, or None when it is not an I/O failure. safetensors reports its own I/O
    errors as ``SafetensorError("... I/O error: No space left on device (os error 28) at path ...")``,
    not as an OSError: the errno and path are read back from that text."""
    if isinstance(exc, OSError):
        return exc
    if type(exc).__name__ == "SafetensorError":
        m = re.search(r"\(os error (\d+)\)", str(exc))
        if m:
            code = int(m.group(1))
            at = re.search(r'at path "([^"]*)"', str(exc))
            return OSError(code, os.strerror(code), at.group(1) if at else None)
    return None


def _rank_from_env() -> int:
    return int(os.environ.get("RANK", "0"))


@contextlib.contextmanager
def writing(path: str | os.PathLike[str], what: str, note: str = "") -> Iterator[None]:
    """Around rallyrl's own writes under the run directory: an I/O failure inside becomes one
    ``RunDirWriteError`` line, "<what>: cannot write <file>: <OS reason> (<ERRNO>); <hint>[; note]",
    instead of a traceback through safetensors or json internals. Anything else passes unchanged."""
    try:
        yield
    except RunDirWriteError:
        raise
    except Exception as e:
        err = os_error_of(e)
        if err is None:
            raise
        where = err.filename if err.filename else path
        code = errno.errorcode.get(err.errno or 0, "")
        reason = (err.strerror or str(err)) + (f" ({code})" if code else "")
        hint = _IO_HINTS.get(err.errno or 0, "check the file system of train.run_dir")
        message = f"{what}: cannot write {Path(where)}: {reason}; {hint}" + (f"; {note}" if note else "")
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        raise RunDirWriteError(message, Failure(_rank_from_env(), type(e).__name__, str(e), tb)) from e


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM seen by the CLI's handler, delivered like Ctrl-C so the trainer stops the same
    way; the exit code is 128 + the signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.exit_code = 128 + signum


class Preempted(Interrupted):
    """The run stopped itself after a SIGTERM or SIGUSR1 (``checkpoint.on_signal``): every rank finished
    the same iteration and ``checkpoint`` was written. The exit code is 143 whichever signal it was (a
    job scheduler reads 143 as "terminated on request")."""

    def __init__(self, signum: int, iteration: int, checkpoint: Path) -> None:
        super().__init__(signum)
        self.iteration, self.checkpoint = iteration, checkpoint
        self.exit_code = 128 + signal.SIGTERM


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
    _stops_requested.clear()


# Pre-emption (``checkpoint.on_signal``): SIGTERM and SIGUSR1 only ask the run to stop. The handler
# records the signal and returns, so whatever this rank is doing (an update, a collective, a checkpoint
# write) finishes untouched; the ranks agree once per iteration (``dist.any_stop``) and stop together
# after the same iteration, with a checkpoint. A second signal is recorded the same way: the checkpoint
# being written is finished, then the run exits. SIGKILL cannot be caught and stays what it is.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_stops_requested: list[int] = []


def stop_requested(signum: int, frame: Any = None) -> None:
    """The signal handler of ``checkpoint.on_signal``: remember the signal; the loop acts on it."""
    _stops_requested.append(signum)


def requested_stop() -> int:
    """The first stop signal this process received (0 for none)."""
    return _stops_requested[0] if _stops_requested else 0


class TrackerError(StageError):
    """An experiment tracker of ``train.report_to`` could not start (on the main rank)."""

    what = "tracker"


class CallbackError(StageError):
    """A callback passed to ``rallyrl.train(callbacks=...)`` raised or returned something unexpected."""

    what = "callback"
