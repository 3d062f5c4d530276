"""rallyrl.threads.call_within: the result, the callee's own exception, and a timeout that does not wait
for a hung call."""

import threading
import time

import pytest

from rallyrl.threads import call_within


def test_returns_the_result_from_another_thread():
    seen = []
    out = call_within(5, lambda: seen.append(threading.current_thread().name) or 7, "t-name", RuntimeError)
    assert out == 7 and seen == ["t-name"]


def test_the_callees_exception_reaches_the_caller():
    def boom():
        raise KeyError("inside")

    with pytest.raises(KeyError, match="inside"):
        call_within(5, boom, "t", RuntimeError)


def test_a_hung_call_raises_the_timeout_error_without_waiting_for_it():
    release = threading.Event()
    t0 = time.perf_counter()
    with pytest.raises(TimeoutError, match="too slow"):
        call_within(0.2, release.wait, "t", lambda: TimeoutError("too slow"))
    assert time.perf_counter() - t0 < 5  # the caller left; the daemon thread is still waiting
    release.set()
