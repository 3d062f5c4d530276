"""Where environments and tools run: one asyncio event loop on a daemon thread per process.

The episode loop hands every running episode's ``reset`` / ``step`` of a turn to the runner at once and
waits for all of them (the next turn's generation is one engine batch, so it starts when the batch's
last episode is ready: episodes advance in lock-step turns, which keeps the sampled tokens independent
of how long tools take; see docs/environments.md). Inside the turn everything is concurrent:

- ``async`` tools and steps are coroutines on the loop; sync ones run each on its own daemon thread,
  awaited from the loop, so a slow or blocking sync tool never stalls the loop or the other calls (TRL's
  async trainer ran sync tools on its event loop and refused async ones);
- at most ``max_concurrent`` tool calls run at once per process (a semaphore; the others queue);
- each tool call is bounded by ``timeout_s`` (``env.tool_timeout_s``); a sync call that overruns cannot
  be killed: it is abandoned on its thread and the model is told it timed out (or the run stops, with
  ``on_error: fail``);
- the whole turn is bounded too (``turn_timeout_s``, the run's ``dist.timeout_s``): an ``async`` tool
  that blocks the loop (``time.sleep`` in an ``async def``) ends the run with a clear error instead of
  hanging this rank while the others wait for it.

``call_tool`` is what ``ToolEnv`` (and any custom environment) awaits to run a tool under these limits;
it finds the runner of the episode it runs in through a context variable.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import inspect
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any


class ToolFailure(RuntimeError):
    """A tool raised or timed out with ``env.on_tool_error: fail`` (the run stops on every rank)."""

    def __init__(self, name: str, error: str) -> None:
        super().__init__(f"tool {name!r} failed: {error}")
        self.tool, self.error = name, error


class EnvTimeout(TimeoutError):
    """An environment call (a turn's steps, or a reset/step bounded by ``env.tool_timeout_s``) overran."""


def _in_thread(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> asyncio.Future:
    """Run a sync callable on a fresh daemon thread; an awaitable of its result on the running loop.
    A fresh thread (not a pool): a call that never returns holds only its own thread, never a slot that
    later calls would queue behind."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    ctx = contextvars.copy_context()  # the thread sees the episode's runner (call_tool inside a sync step)

    def settle(value: Any, error: BaseException | None) -> None:
        if fut.done():  # timed out and cancelled meanwhile: the late result is dropped
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(value)

    def run() -> None:
        try:
            value = ctx.run(fn, *args, **kwargs)
        except BaseException as e:  # handed to the awaiting coroutine
            loop.call_soon_threadsafe(settle, None, e)
        else:
            loop.call_soon_threadsafe(settle, value, None)

    threading.Thread(target=run, name="rallyrl-env", daemon=True).start()
    return fut


async def maybe_await(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``: awaited if it is a coroutine function, else run on its own thread."""
    if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None)):
        return await fn(*args, **kwargs)
    out = await _in_thread(fn, *args, **kwargs)
    if inspect.isawaitable(out):  # a sync function that returned a coroutine
        out = await out
    return out


class EnvRunner:
    """Runs environment calls and tools for one process (see the module docstring)."""

    def __init__(self, timeout_s: float | None = None, max_concurrent: int = 8, on_error: str = "message",
                 turn_timeout_s: float | None = None) -> None:
        if on_error not in ("message", "fail"):
            raise ValueError(f"env.on_tool_error must be 'message' or 'fail', got {on_error!r}")
        self.timeout_s, self.max_concurrent, self.on_error = timeout_s, max_concurrent, on_error
        self.turn_timeout_s = turn_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sem: asyncio.Semaphore | None = None

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None or self._loop.is_closed():
            loop = asyncio.new_event_loop()
            started = threading.Event()

            def serve() -> None:
                asyncio.set_event_loop(loop)
                started.set()
                loop.run_forever()

            threading.Thread(target=serve, name="rallyrl-env-loop", daemon=True).start()
            started.wait()
            self._loop = loop
            self._sem = asyncio.Semaphore(self.max_concurrent)
        return self._loop

    def run(self, calls: Sequence[Callable[[], Awaitable[Any]]]) -> list[tuple[Any, BaseException | None]]:
        """Run ``calls`` (zero-argument coroutine functions) concurrently on the loop and wait for all of
        them (at most ``turn_timeout_s``). Returns ``(value, None)`` or ``(None, exception)`` per call, in order."""
        if not calls:
            return []
        loop = self._ensure_loop()

        async def one(call: Callable[[], Awaitable[Any]]) -> tuple[Any, BaseException | None]:
            # gather() runs each call as its own task, in its own copy of the context: the runner set
            # here is seen by this call only (and by the threads it starts), never reset across contexts.
            _CURRENT.set(self)
            try:
                return await call(), None
            except Exception as e:
                return None, e

        async def every() -> list[tuple[Any, BaseException | None]]:
            return list(await asyncio.gather(*(one(c) for c in calls)))

        fut = asyncio.run_coroutine_threadsafe(every(), loop)
        try:
            return fut.result(timeout=self.turn_timeout_s)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise EnvTimeout(f"the environment steps of a turn did not finish within {self.turn_timeout_s:g} s "
                             f"(dist.timeout_s); an async tool or step that blocks the event loop (e.g. time.sleep "
                             f"in an async def) holds every episode of this rank: make it sync or await "
                             f"asyncio.sleep") from None

    async def bounded(self, what: str, fn: Callable[..., Any], args: tuple = (),
                      kwargs: dict[str, Any] | None = None) -> Any:
        """``fn(*args, **kwargs)`` (sync or async) within ``timeout_s``; ``EnvTimeout`` naming ``what`` if
        it overruns."""
        try:
            return await asyncio.wait_for(maybe_await(fn, *args, **(kwargs or {})), self.timeout_s)
        except asyncio.TimeoutError:
            raise EnvTimeout(f"{what} did not return within env.tool_timeout_s={self.timeout_s:g} s") from None

    async def call_tool(self, name: str, fn: Callable[..., Any], arguments: dict[str, Any]) -> tuple[Any, str | None]:
        """Run one tool call under the limits: ``(output, None)``, or ``(None, why)`` when it raised or timed
        out and ``on_error`` is ``message``; raises ``ToolFailure`` with ``fail``."""
        assert self._sem is not None
        async with self._sem:
            try:
                return await self.bounded(f"tool {name!r}", fn, (), arguments), None
            except EnvTimeout as e:
                error = str(e)
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
        if self.on_error == "fail":
            raise ToolFailure(name, error)
        return None, error

    def close(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._loop = None


_CURRENT: contextvars.ContextVar[EnvRunner | None] = contextvars.ContextVar("rallyrl_env_runner", default=None)


async def call_tool(name: str, fn: Callable[..., Any], arguments: dict[str, Any]) -> tuple[Any, str | None]:
    """Run a tool under the limits of the episode's runner (``EnvRunner.call_tool``); outside an episode
    (an environment tried by hand) the tool simply runs, with errors returned as messages."""
    runner = _CURRENT.get()
    if runner is None:
        try:
            return await maybe_await(fn, **arguments), None
        except Exception as e:
            return None, f"{type(e).__name__}: {e}"
    return await runner.call_tool(name, fn, arguments)
