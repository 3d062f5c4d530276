"""A call on a helper thread, waited for with a timeout: how rallyrl bounds user code and engine pushes
that may hang (a reward function, a vLLM weight push), so that a hang becomes an error every rank can
agree on instead of a run that never returns."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def call_within(seconds: float, fn: Callable[[], T], name: str, timeout: Callable[[], BaseException]) -> T:
    """``fn()`` on a daemon thread called ``name``, waited for at most ``seconds``. Its result is returned
    and its exception re-raised in the caller's thread; past ``seconds`` the error ``timeout()`` makes is
    raised. A thread cannot be killed: an overrunning call is left running (daemon) and the caller stops."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["out"] = fn()
        except BaseException as e:  # re-raised on the caller's thread
            box["error"] = e

    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        raise timeout()
    if "error" in box:
        raise box["error"]
    return box["out"]
