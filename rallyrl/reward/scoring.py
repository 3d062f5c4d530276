"""Calling reward functions: the arguments of each function's signature (trlx's or TRL's:
``signature.py``), one bounded call inside ``isolated_rng()`` (``reward.timeout_s``), and
``score_samples``: every function over a batch in micro-batches, validated and combined with its weight
(None = unscorable). Raises on any failure; the reward step (``step.py``) makes the failure collective,
the reward server (``server.py``) answers it with a 500.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from collections.abc import Sequence
from typing import Any

from .samples import NamedRewardFn, Reward, RewardFn, Samples, StepStats, micro_batches
from .signature import call_arguments, detect_signature, trlx_kwargs
from .validate import validate_rewards

# `seeding` and `client` are imported where they are used: `seeding` imports torch, and `import rallyrl`
# (the `rallyrl train --nproc N` launcher process, `rallyrl check`) stays free of it.

_NO_LENGTH = 2**62  # see score_samples


def call_kwargs(samples: Samples, tokenizer: Any) -> dict[str, Any]:
    """trlx-compatible keyword arguments (the metric function's): every metadata column as a per-sample
    list (None where a sample lacks it), plus ``output_token_ids`` and ``tokenizer``; a column of one of
    the argument names is refused (``signature.trlx_kwargs``)."""
    return trlx_kwargs(samples, tokenizer)


class RewardTimeoutError(TimeoutError):
    """An in-process reward call took longer than ``reward.timeout_s``."""


def _call_bounded(fn: RewardFn, args: tuple, kwargs: dict[str, Any], timeout_s: float, name: str) -> Any:
    """``fn(*args, **kwargs)`` inside ``isolated_rng()`` on a helper thread, waited for at most
    ``timeout_s``. The caller's thread only waits meanwhile, so the RNG save/restore cannot race with it;
    a call that overruns cannot be killed: it is left running (a daemon thread) and the run stops."""
    import torch

    from ..seeding import isolated_rng
    from ..threads import call_within

    # The current CUDA device is per thread: the helper uses the caller's (a rank's own GPU, not cuda:0).
    device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def run() -> Any:
        if device is not None:
            torch.cuda.set_device(device)
        with isolated_rng():
            return fn(*args, **kwargs)

    return call_within(timeout_s, run, "rallyrl-reward-call", lambda: RewardTimeoutError(
        f"reward function {name!r} did not return within reward.timeout_s={timeout_s:g} s"))


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
    n = len(samples)
    rewards = [Reward(0.0, scorable=False) for _ in range(n)]  # scorable once some function gives a value
    stats = StepStats()
    for nf in fns:
        style = nf.signature or detect_signature(nf.fn, nf.name)
        for a, b in micro_batches(n, batch_size):
            part = samples.slice(a, b)
            args, kwargs = call_arguments(nf.fn, style, part, tokenizer)
            t0 = time.perf_counter()
            out = _call(nf, args, kwargs, isolate, timeout_s)
            stats.time_reward += time.perf_counter() - t0
            stats.calls += 1
            stats.samples += b - a
            # None: token ids unknown (a server request without them); the dense length is then
            # checked on the client, which has them.
            lengths = [len(t) if t is not None else _NO_LENGTH for t in part.output_token_ids]
            checked = validate_rewards(out, lengths, fn_name=f"reward function {nf.name!r}", offset=offset + a)
            _combine(rewards[a:b], checked, lengths, nf)
    return rewards, stats


def _call(nf: NamedRewardFn, args: tuple, kwargs: dict[str, Any], isolate: bool, timeout_s: float | None) -> Any:
    """One call of ``nf``: an in-process function with a ``timeout_s`` on a helper thread
    (``_call_bounded``), anything else here; inside ``isolated_rng()`` unless ``isolate`` is False."""
    from ..seeding import isolated_rng
    from .client import RemoteReward

    fn = _awaiting(nf.fn)
    if timeout_s is not None and isolate and not isinstance(nf.fn, RemoteReward):
        return _call_bounded(fn, args, kwargs, timeout_s, nf.name)
    with isolated_rng() if isolate else contextlib.nullcontext():
        return fn(*args, **kwargs)


def _awaiting(fn: RewardFn) -> RewardFn:
    """``fn``, with what an ``async`` reward function (TRL allows them) returns run to completion on an
    event loop of its own, on the calling thread (``_call_bounded``'s helper thread, or the caller's):
    inside ``isolated_rng()`` and the time bound like any call."""

    def call(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        if inspect.iscoroutine(out):
            import asyncio

            out = asyncio.run(out)
        return out

    return call


def _combine(rewards: list[Reward], checked: list[Any], lengths: list[int], nf: NamedRewardFn) -> None:
    """Add one function's validated output (``checked``, aligned with ``rewards``) with its weight: a
    scalar to ``score``, a per-token list to ``dense`` token by token; ``components`` keeps the
    function's own unweighted value (a dense one summed). None: this function has no say on that sample
    (it adds nothing and has no component, as TRL's nansum over functions); a sample stays unscorable
    only while every function has returned None for it."""
    for rw, r, length in zip(rewards, checked, lengths):
        if r is None:
            continue
        rw.scorable = True
        if isinstance(r, list):
            n_tok = length if length != _NO_LENGTH else len(r)
            dense = rw.dense if rw.dense is not None else [0.0] * n_tok
            dense.extend([0.0] * (len(r) - len(dense)))  # unknown token count: as long as needed
            for t, x in enumerate(r):
                dense[t] += nf.weight * x
            rw.dense = dense
            rw.components[nf.name] = sum(r)
        else:
            rw.score += nf.weight * r
            rw.components[nf.name] = r
