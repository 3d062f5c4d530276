"""Every collective rallyrl uses, in one place (style rule 6).

All functions work at world size 1 without a process group (they become no-ops or identities), so a
single-process run executes exactly the same code as a multi-process one. Collectives are batched: a dict
of statistics is reduced with ONE all-reduce of a stacked tensor, not one call per key.

Object collectives (gather/scatter of Python objects) carry the reward step's samples and results. On
NCCL they need the current CUDA device to be set, which ``accelerate`` does when it starts.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as tdist


def is_distributed() -> bool:
    return tdist.is_available() and tdist.is_initialized() and tdist.get_world_size() > 1


def world_size() -> int:
    return tdist.get_world_size() if is_distributed() else 1


def rank() -> int:
    return tdist.get_rank() if is_distributed() else 0


def local_world_size() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def is_main() -> bool:
    return rank() == 0


def init_accelerator(timeout_s: float) -> Any:
    """Create the ``accelerate.Accelerator`` (and so the process group, when launched with several ranks).

    Without a GPU ``Accelerator()`` would silently report world size 1 under torchrun, so ``cpu=True`` is
    passed there: the ranks then form a gloo group. With GPUs the backend is NCCL. ``timeout_s`` bounds
    how long a rank waits in a collective for a dead or stuck peer.
    """
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    kwargs = InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=timeout_s))
    return Accelerator(cpu=not torch.cuda.is_available(), kwargs_handlers=[kwargs])


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


def all_reduce_max(x: torch.Tensor) -> torch.Tensor:
    if not is_distributed():
        return x.clone()
    y = x.detach().to(_device()).clone()
    tdist.all_reduce(y, op=tdist.ReduceOp.MAX)
    return y.to(x.device)


def reduce_stats(stats: dict[str, float], op: str = "mean") -> dict[str, float]:
    """Reduce a dict of scalars over ranks with ONE all-reduce (``op``: "mean", "sum" or "max").

    Every rank must pass the same keys (they are sorted so the order cannot differ).
    """
    if not stats:
        return {}
    keys = sorted(stats)
    vec = torch.tensor([float(stats[k]) for k in keys], dtype=torch.float64)
    if op == "max":
        vec = all_reduce_max(vec)
    else:
        vec = all_reduce_sum(vec)
        if op == "mean":
            vec = vec / world_size()
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


def barrier() -> None:
    if is_distributed():
        tdist.barrier()
