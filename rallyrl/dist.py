"""Every collective rallyrl uses, in one place (style rule 6).

All functions work at world size 1 without a process group (they become no-ops or identities), so a
single-process run executes exactly the same code as a multi-process one. Collectives are batched: a dict
of statistics is reduced with ONE all-reduce of a stacked tensor, not one call per key.

Object collectives (gather/scatter of Python objects) carry the reward step's samples and results. On
NCCL they need the current CUDA device to be set, which ``accelerate`` does when it starts.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from .errors import CollectiveTimeoutError, Failure, StageError

T = TypeVar("T")


class _LazyModule:
    """Imported on first use: modules that only name ``dist`` (the CLI, the launcher's checks) do not pay
    torch's import (seconds) until a collective is actually used."""

    def __init__(self, name: str) -> None:
        self._name, self._module = name, None

    def __getattr__(self, attr: str) -> Any:
        if self._module is None:
            self._module = importlib.import_module(self._name)
        return getattr(self._module, attr)


torch = _LazyModule("torch")
tdist = _LazyModule("torch.distributed")


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


def rank() -> int:
    return tdist.get_rank() if is_distributed() else 0


def expected_world_size() -> int:
    """The world size this process will join: the launcher's ``WORLD_SIZE`` (torchrun, accelerate),
    known before the process group starts, so inputs are checked for it first."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_world_size() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def is_main() -> bool:
    return rank() == 0


_accelerator: Any = None
_sharding = "ddp"  # model.sharding, set once by init_accelerator


def init_accelerator(timeout_s: float, sharding: str = "ddp") -> torch.device:
    """Create the ``accelerate.Accelerator`` (and so the process group, when launched with several ranks);
    returns this rank's device.

    Without a GPU ``Accelerator()`` would silently report world size 1 under torchrun, so ``cpu=True`` is
    passed there: the ranks then form a gloo group. With GPUs the backend is NCCL. ``timeout_s`` bounds
    how long a rank waits in a collective for a dead or stuck peer. ``sharding`` (``model.sharding``)
    chooses how ``shard`` / ``prepare`` and the gradient helpers below treat the trained model.
    """
    global _accelerator, _timeout_s, _sharding
    _timeout_s, _sharding = timeout_s, sharding
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    kwargs = InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=timeout_s))
    _accelerator = Accelerator(cpu=not torch.cuda.is_available(), kwargs_handlers=[kwargs])
    return _accelerator.device


def is_sharded() -> bool:
    """True when models are FSDP-sharded: ``model.sharding: fsdp`` with several ranks (one process has
    nothing to shard over and runs exactly as ``ddp``)."""
    return _sharding == "fsdp" and is_distributed()


# --- the trained model: DDP (through accelerate) or FSDP2 (rallyrl.sharding) ----------------------
# Under DDP the gradient all-reduce happens in backward(); under FSDP2 every forward and backward
# gathers each block's weights and backward reduce-scatters its gradients.


def shard(model: torch.nn.Module, forward_methods: Sequence[str] = ()) -> torch.nn.Module:
    """FSDP: shard ``model`` in place (each transformer block, then the root; ``forward_methods`` run the
    model like ``forward``, e.g. ``generate``). DDP: unchanged. Called for the policy BEFORE its
    optimizer is created (the optimizer must hold the shards) and for the frozen reference."""
    if not is_sharded():
        return model
    from . import sharding

    return sharding.shard(model, forward_methods)


def prepare(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[torch.nn.Module, Any]:
    """Wrap for data parallelism (DDP when there are several ranks; unchanged at world size 1 and under
    FSDP, where ``shard`` already did the work)."""
    if is_sharded():
        return model, optimizer
    return _accelerator.prepare(model, optimizer)


def gathered(*models: torch.nn.Module) -> Any:
    """Context in which the models' weights are whole on every rank (FSDP: one all-gather per unit on
    entry, resharded on exit; DDP: nothing to do). Stages whose forward count may differ between
    ranks (generation, rollout scoring, eval) run inside it, so they contain no collective."""
    if not is_sharded():
        return contextlib.nullcontext()
    from . import sharding

    return sharding.gathered(*models)


def backward(loss: torch.Tensor) -> None:
    """Backward pass; under DDP it all-reduces (averages) the gradients unless inside ``no_sync``;
    under FSDP it reduce-scatters (averages) them into each rank's shard."""
    if is_sharded():
        loss.backward()
    else:
        _accelerator.backward(loss)


def no_sync(model: torch.nn.Module) -> Any:
    """Context in which backward() only accumulates gradients locally (gradient accumulation)."""
    if is_sharded():
        from . import sharding

        return sharding.no_sync(model)
    return _accelerator.no_sync(model)


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the (already synchronised) gradients; returns the norm before clipping (a 0-dim tensor:
    reading it is left to the caller's one host sync per step). Under FSDP the norm is of the whole
    gradient (the shards' partial norms are all-reduced), the same number DDP reports."""
    if is_sharded():
        from . import sharding

        return sharding.clip_grad_norm(model, max_norm)
    return _accelerator.clip_grad_norm_(model.parameters(), max_norm)


def local_nbytes(tensors: Any) -> int:
    """Bytes of ``tensors`` held by this rank (FSDP: the local shards), shared storage counted once."""
    from . import sharding

    return sharding.local_nbytes(tensors)


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """Collective under FSDP: the whole model state dict on rank 0 (CPU, gathered unit by unit), an
    empty dict elsewhere. None when the model is not sharded (every rank already holds all of it)."""
    if not is_sharded():
        return None
    from . import sharding

    return sharding.full_state_dict(model)


def _device() -> torch.device:
    if is_distributed() and tdist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over all ranks (returns a new tensor on the input's device)."""
    if not is_distributed():
        return x.clone()
    y = x.detach().to(_device()).clone()
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


def broadcast_object(obj: Any, src: int = 0) -> Any:
    if not is_distributed():
        return obj
    box = [obj if rank() == src else None]
    tdist.broadcast_object_list(box, src=src)
    return box[0]


def agree(fn: Callable[[], T], error: type[StageError], *, main_only: bool = False, what: str | None = None) -> T:
    """Run ``fn`` on every rank (or on the main rank only) and agree on its outcome: if it raised on
    any rank, every rank raises ``error`` carrying the first failure (lowest rank), right here, instead
    of leaving peers blocked in their next collective. The one failure mechanism of every stage that
    can fail on some ranks only (reward, metric_fn, checkpoint I/O, resume choice).

    ``main_only``: ``fn`` runs on rank 0 and its return value is broadcast to every rank (one
    broadcast); otherwise each rank keeps its own value and the ranks exchange only their failures (one
    all-gather). A ``StageError`` raised inside ``fn`` keeps its message (it is not wrapped twice).
    """
    value: Any = None
    failure: Failure | None = None
    if is_main() or not main_only:
        try:
            value = fn()
        except Exception as e:  # reported to every rank below, then raised there
            failure = Failure.of(e, rank())
    if main_only:
        outcome = broadcast_object((failure, value), src=0)
        failures, value = [outcome[0]], outcome[1]
    else:
        failures = all_gather_objects(failure)
    raise_failures(failures, error, what)
    return value


def raise_failures(failures: Sequence[Failure | None], error: type[StageError], what: str | None = None) -> None:
    """Raise ``error`` (identically on every rank: all ranks pass the same list) if any rank failed."""
    if any(failures):
        raise error.from_failures(failures, what)


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
