"""Every torch.distributed collective rallyrl calls, in one place (style rule 6), and the facts of the
process group (world size, rank, main rank, the stage a rank is in, the collective timeout).

All functions work at world size 1 without a process group (they become no-ops or identities), so a
single-process run executes exactly the same code as a multi-process one. Collectives are batched: a dict
of statistics is reduced with ONE all-reduce of a stacked tensor, not one call per key.

Object collectives (gather/scatter of Python objects) carry the reward step's samples and results. On
NCCL they need the current CUDA device to be set, which ``accelerate`` does when it starts.

``agree`` / ``raise_failures`` are the one failure mechanism of every stage that can fail on some ranks
only. The trained model's data parallelism (DDP through accelerate, or FSDP2) is in ``accelerator.py``
and ``sharding.py`` beside this module.
"""

from __future__ import annotations

import importlib
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from ..errors import CollectiveTimeoutError, Failure, RunDirWriteError, StageError

T = TypeVar("T")


class LazyModule:
    """Imported on first use: modules that only name ``dist`` (the CLI, the launcher's checks) do not pay
    torch's import (seconds) until a collective is actually used. ``accelerator.py`` and ``sharding.py``
    use this module's ``torch`` for the same reason."""

    def __init__(self, name: str) -> None:
        self._name, self._module = name, None

    def __getattr__(self, attr: str) -> Any:
        if self._module is None:
            self._module = importlib.import_module(self._name)
        return getattr(self._module, attr)


torch = LazyModule("torch")
tdist = LazyModule("torch.distributed")


# --- the stage a rank is in, so a collective timeout can say where it waited --------------------

_stage = "start-up"
_timeout_s = 0.0


def stage(name: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Decorator: while the function runs this rank is in stage ``name``. Left set when it raises, so
    a collective timeout raised inside is reported with the stage it happened in."""
    import functools

    def wrap(fn: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> T:
            global _stage
            outer, _stage = _stage, name
            value = fn(*args, **kwargs)
            _stage = outer
            return value

        return inner

    return wrap


def set_timeout(timeout_s: float) -> None:
    """How long a rank waits in a collective (``dist.timeout_s``, given to the process group by
    ``init_accelerator``): named by ``timeout_error``'s message."""
    global _timeout_s
    _timeout_s = timeout_s


def timeout_error(e: BaseException) -> CollectiveTimeoutError | None:
    """A collective's timeout (gloo: "Timed out waiting ...ms", NCCL: "Watchdog caught collective
    operation timeout") translated to one line: which rank waited, in which stage, for how long, and
    what to change; None for any other error."""
    text = str(e)
    # A StageError (e.g. a RewardError naming reward.timeout_s) is already a typed, agreed report.
    if not isinstance(e, RuntimeError) or isinstance(e, StageError):
        return None
    if not any(k in text for k in ("Timed out", "timed out", "Timeout", "timeout")):
        return None
    return CollectiveTimeoutError(
        f"rank {rank()} waited {_timeout_s:g} s (dist.timeout_s) for the other ranks in the {_stage} and gave "
        f"up: a rank is stuck or died there (a hung reward function or server, a deadlock, a lost node). If "
        f"the wait is legitimate (a slow reward model), raise dist.timeout_s or set reward.timeout_s")


def is_distributed() -> bool:
    return tdist.is_available() and tdist.is_initialized() and tdist.get_world_size() > 1


def world_size() -> int:
    return tdist.get_world_size() if is_distributed() else 1


def colocated_engine_options() -> dict[str, str]:
    """Options for an in-process generation engine (vLLM) on every rank of a multi-process GPU run: it
    joins this module's process group ("external_launcher": each rank its own engine, as TRL's colocate
    mode) instead of starting its own. Here, because the group and its lifetime are this module's."""
    return {"distributed_executor_backend": "external_launcher"} if world_size() > 1 else {}


def keep_group_from(engine_core: Any) -> None:
    """An in-process engine would tear down the default process group when it is collected (its shutdown
    assumes the group is its own); the group stays this module's, ended by ``shutdown()``."""
    engine_core._finalizer.detach()


def rank() -> int:
    return tdist.get_rank() if is_distributed() else 0


def expected_world_size() -> int:
    """The world size this process will join: the launcher's ``WORLD_SIZE`` (torchrun, accelerate),
    known before the process group starts, so inputs are checked for it first."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def expected_rank() -> int:
    """This process's global rank as its launcher set it (``RANK``; 0 without one), known before the
    process group starts: the main rank takes the run-directory lock before anything heavy."""
    return int(os.environ.get("RANK", "0"))


def local_world_size() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def is_main() -> bool:
    return rank() == 0


def collective_device() -> torch.device:
    """Where tensors of a collective live: this rank's GPU under NCCL, else the CPU (gloo)."""
    if is_distributed() and tdist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over all ranks (returns a new tensor on the input's device)."""
    if not is_distributed():
        return x.clone()
    y = x.detach().to(collective_device()).clone()
    tdist.all_reduce(y, op=tdist.ReduceOp.SUM)
    return y.to(x.device)


def reduce_stats(stats: dict[str, float]) -> dict[str, float]:
    """Sum a dict of scalars over ranks with ONE all-reduce (callers derive means from sums).

    Every rank must pass the same keys (they are sorted so the order cannot differ).
    """
    if not stats:
        return {}
    keys = sorted(stats)
    vec = all_reduce_sum(torch.tensor([float(stats[k]) for k in keys], dtype=torch.float64))
    return {k: float(v) for k, v in zip(keys, vec.tolist())}


def reduce_max(stats: dict[str, float]) -> dict[str, float]:
    """The maximum over ranks of each value of a dict of scalars, with ONE all-reduce (same keys on every rank)."""
    if not stats or not is_distributed():
        return dict(stats)
    keys = sorted(stats)
    vec = torch.tensor([float(stats[k]) for k in keys], dtype=torch.float64, device=collective_device())
    tdist.all_reduce(vec, op=tdist.ReduceOp.MAX)
    return {k: float(v) for k, v in zip(keys, vec.tolist())}


def gather_objects(obj: Any, dst: int = 0) -> list[Any] | None:
    """Gather one picklable object per rank onto ``dst`` (a list in rank order there, None elsewhere)."""
    if not is_distributed():
        return [obj]
    out: list[Any] | None = [None] * world_size() if rank() == dst else None
    tdist.gather_object(obj, out, dst=dst)
    return out


def scatter_objects(objs: list[Any] | None, src: int = 0) -> Any:
    """Send ``objs[r]`` from ``src`` to each rank ``r``; returns this rank's object."""
    if not is_distributed():
        assert objs is not None and len(objs) == 1
        return objs[0]
    out: list[Any] = [None]
    tdist.scatter_object_list(out, objs if rank() == src else None, src=src)
    return out[0]


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank receives the list of all ranks' objects, in rank order."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * world_size()
    tdist.all_gather_object(out, obj)
    return out


def exchange_objects(outgoing: Sequence[Any]) -> list[Any]:
    """All-to-all of picklable objects: this rank sends ``outgoing[d]`` to rank ``d`` and receives, in rank
    order, what every rank sent it. One object scatter per source rank (``world_size`` collectives, each
    moving only what its source sends; gloo has no object all-to-all). Every rank must call it."""
    if len(outgoing) != world_size():
        raise ValueError(f"exchange_objects: {len(outgoing)} objects for {world_size()} ranks")
    if not is_distributed():
        return list(outgoing)
    return [scatter_objects(list(outgoing) if rank() == src else None, src=src) for src in range(world_size())]


def broadcast_object(obj: Any, src: int = 0) -> Any:
    if not is_distributed():
        return obj
    box = [obj if rank() == src else None]
    tdist.broadcast_object_list(box, src=src)
    return box[0]


def agree(fn: Callable[[], T], error: type[StageError], *, main_only: bool = False, what: str | None = None,
          on_exchange: Callable[[float], None] | None = None) -> T:
    """Run ``fn`` on every rank (or on the main rank only) and agree on its outcome: if it raised on
    any rank, every rank raises ``error`` carrying the first failure (lowest rank), right here, instead
    of leaving peers blocked in their next collective. The one failure mechanism of every stage that
    can fail on some ranks only (reward, metric_fn, checkpoint I/O, resume choice).

    ``main_only``: ``fn`` runs on rank 0 and its return value is broadcast to every rank (one
    broadcast); otherwise each rank keeps its own value and the ranks exchange only their failures (one
    all-gather). A ``StageError`` raised inside ``fn`` keeps its message (it is not wrapped twice).

    ``on_exchange(seconds)``: called on every rank with the time spent in that exchange, before a
    failure is raised (the reward step counts it as ``time/reward_gather``).
    """
    value: Any = None
    failure: Failure | None = None
    if is_main() or not main_only:
        try:
            value = fn()
        except Exception as e:  # reported to every rank below, then raised there
            failure = Failure.of(e, rank())
    t0 = time.perf_counter() if on_exchange is not None else 0.0
    if main_only:
        outcome = broadcast_object((failure, value), src=0)
        failures, value = [outcome[0]], outcome[1]
    else:
        failures = all_gather_objects(failure)
    if on_exchange is not None:
        on_exchange(time.perf_counter() - t0)
    raise_failures(failures, error, what)
    return value


def raise_failures(failures: Sequence[Failure | None], error: type[StageError], what: str | None = None) -> None:
    """Raise ``error`` (identically on every rank: all ranks pass the same list) if any rank failed. A
    first failure that is rallyrl's own write to the run directory (``errors.writing``) is raised as the
    ``RunDirWriteError`` it is, so the CLI prints its one line (path, OS reason, hint)."""
    got = sorted((f for f in failures if f is not None), key=lambda f: f.rank)
    if got:
        if got[0].is_report and got[0].error_type == RunDirWriteError.__name__:
            error = RunDirWriteError
        raise error.from_failures(failures, what)


def any_stop(signum: int) -> int:
    """Pre-emption: did any rank receive a stop signal (``checkpoint.on_signal``)? One all-reduce (max)
    of one integer: a signal may reach one rank only, or ranks at different points of the iteration, and
    every rank must stop after the same iteration. Returns the largest signal number seen (0: none)."""
    if not is_distributed():
        return signum
    flag = torch.tensor([signum], dtype=torch.int64, device=collective_device())
    tdist.all_reduce(flag, op=tdist.ReduceOp.MAX)
    return int(flag.item())


def shutdown() -> None:
    """End this process's part in the process group, after a last barrier: every rank leaves together
    and the group is destroyed before the interpreter exits. Letting interpreter teardown destroy it
    instead races with peers still closing their connections and occasionally aborts a rank
    ("terminate called without an active exception") after a run that succeeded."""
    if is_distributed():
        tdist.barrier()
        tdist.destroy_process_group()


def barrier() -> None:
    if is_distributed():
        tdist.barrier()

