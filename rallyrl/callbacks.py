"""Callbacks: ``rallyrl.train(..., callbacks=[...])``.

A callback is any object with one or more of these methods (all optional; a base class is not needed):

- ``on_start(info)``: once, before the first iteration (``info``: a dict with ``run_dir``, ``config``,
  ``world_size``, ``iterations``, ``start_iteration`` (0, or the checkpoint's on a resume),
  ``resumed_from`` (a checkpoint path or None) and ``num_rollouts``);
- ``on_iteration(step, metrics)``: after each iteration is logged (``metrics``: that row of
  ``metrics.jsonl``, eval metrics included on an eval iteration). Returning ``"stop"`` ends the run
  after this iteration on every rank: a checkpoint (when ``checkpoint.interval`` is set), ``final/``,
  exit 0. The run stays resumable: ``train.resume=latest`` continues from that iteration;
- ``on_eval(step, metrics)``: after each evaluation (step 0: before training).

Callbacks run on the main rank only, in the order given; the main rank's decision is broadcast, so every
rank stops at the same iteration. A callback that raises (or returns something other than None or
``"stop"``) stops every rank with a ``CallbackError`` naming it, the hook and the iteration.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from . import dist
from .errors import CallbackError, Failure

STOP = "stop"
HOOKS = ("on_start", "on_iteration", "on_eval")


class Callback(Protocol):
    """The hooks a callback may have (each optional)."""

    def on_start(self, info: dict[str, Any]) -> None: ...

    def on_iteration(self, step: int, metrics: dict[str, float]) -> str | None: ...

    def on_eval(self, step: int, metrics: dict[str, float]) -> None: ...


def name_of(cb: Any) -> str:
    return getattr(cb, "__name__", None) or type(cb).__name__


class Callbacks:
    """The run's callbacks; every method is called on every rank and runs the hooks on the main rank."""

    def __init__(self, callbacks: Sequence[Any] | None) -> None:
        self.callbacks = list(callbacks or [])
        self.stopped_by: str | None = None  # "EarlyStop.on_iteration" once one asked to stop

    def start(self, info: dict[str, Any]) -> None:
        def check_and_start() -> None:
            for i, cb in enumerate(self.callbacks):
                if not any(callable(getattr(cb, h, None)) for h in HOOKS):
                    raise CallbackError(f"callbacks[{i}] ({name_of(cb)}) has none of the methods "
                                        f"{', '.join(HOOKS)}; pass objects that have at least one")
            self._run("on_start", None, info)

        dist.agree(check_and_start, CallbackError, main_only=True)

    def iteration(self, step: int, metrics: dict[str, float]) -> bool:
        """True (on every rank) when a callback asked to stop after iteration ``step``."""
        self.stopped_by = dist.agree(lambda: self._run("on_iteration", step, step, metrics), CallbackError,
                                     main_only=True)
        return self.stopped_by is not None

    def eval(self, step: int, metrics: dict[str, float]) -> None:
        dist.agree(lambda: self._run("on_eval", step, step, metrics), CallbackError, main_only=True)

    def _run(self, hook: str, step: int | None, *args: Any) -> str | None:
        """Call ``hook`` on every callback that has it; the first that asked to stop, as
        ``"Name.on_iteration"`` (None if none did)."""
        stop = None
        where = f" at iteration {step}" if step is not None else ""
        for cb in self.callbacks:
            fn = getattr(cb, hook, None)
            if not callable(fn):
                continue
            what = f"{name_of(cb)}.{hook}"
            try:
                out = fn(*args)
            except Exception as e:
                raise CallbackError(f"callback {what} raised{where}: {type(e).__name__}: {e}",
                                    Failure.of(e, dist.rank())) from e
            if hook == "on_iteration" and out == STOP:
                stop = stop or what
            elif out is not None:
                raise CallbackError(f"callback {what} returned {out!r}{where}; return {STOP!r} to end the run "
                                    f"after this iteration, or None" if hook == "on_iteration" else
                                    f"callback {what} returned {out!r}{where}; it should return None")
        return stop
