"""Every collective rallyrl uses, in one place (style rule 6).

All functions work at world size 1 without a process group (they become no-ops or identities), so a
single-process run executes exactly the same code as a multi-process one. Collectives are batched: a dict
of statistics is reduced with ONE all-reduce of a stacked tensor, not one call per key.

Object collectives (gather/scatter of Python objects) carry the reward step's samples and results. On
NCCL they need the current CUDA device to be set, which ``accelerate`` does when it starts.

``model.sharding: fsdp`` (FSDP2 and its DCP checkpoints) lives here too, in the "FSDP2" section: the
public wrappers (``shard``, ``gathered``, ``no_sync``, ``clip_grad_norm``, ``full_state_dict``,
``save_sharded`` / ``load_sharded``) are all that ``trainer``, ``state`` and ``checkpoint`` see.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

from .errors import CollectiveTimeoutError, Failure, ModelWeightsError, RunDirWriteError, StageError

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


def expected_rank() -> int:
    """This process's global rank as its launcher set it (``RANK``; 0 without one), known before the
    process group starts: the main rank takes the run-directory lock before anything heavy."""
    return int(os.environ.get("RANK", "0"))


def local_world_size() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def is_main() -> bool:
    return rank() == 0


_accelerator: Any = None
_sharding = "ddp"  # model.sharding, set once by init_accelerator
_compute_dtype: torch.dtype | None = None  # train.mixed_precision: bf16 -> torch.bfloat16; no -> None
_plain_torch = False  # accelerate's training wrappers would only add Python around the torch calls (_is_plain)


def init_accelerator(timeout_s: float, sharding: str = "ddp", mixed_precision: str = "no") -> torch.device:
    """Create the ``accelerate.Accelerator`` (and so the process group, when launched with several ranks);
    returns this rank's device.

    Without a GPU ``Accelerator()`` would silently report world size 1 under torchrun, so ``cpu=True`` is
    passed there: the ranks then form a gloo group. With GPUs the backend is NCCL. ``timeout_s`` bounds
    how long a rank waits in a collective for a dead or stuck peer. ``sharding`` (``model.sharding``)
    chooses how ``shard`` / ``prepare`` and the gradient helpers below treat the trained model;
    ``mixed_precision`` (``train.mixed_precision``) the compute dtype ``shard`` gives the models.
    """
    global _accelerator, _timeout_s, _sharding, _compute_dtype, _plain_torch
    _timeout_s, _sharding = timeout_s, sharding
    _compute_dtype = torch.bfloat16 if mixed_precision == "bf16" else None
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    kwargs = InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=timeout_s))
    _accelerator = Accelerator(cpu=not torch.cuda.is_available(), kwargs_handlers=[kwargs])
    _plain_torch = _is_plain(_accelerator)
    return _accelerator.device


def _is_plain(accelerator: Any) -> bool:
    """Whether this accelerator's ``backward``, ``clip_grad_norm_`` and optimizer wrapper would run
    exactly the torch calls ``backward``, ``clip_grad_norm`` and the optimizer make without it: one
    process or DDP (CPU or GPU), no loss scaler (accelerate's own fp16; rallyrl's bf16 needs none), no
    gradient accumulation of accelerate's own. Then rallyrl calls torch directly: the same operations,
    so bit-identical results, without accelerate's per-call Python (its optimizer ``step`` looks the
    ``lomo_optim`` package up on disk twice per call, ``zero_grad`` inspects a signature, ``backward``
    divides by 1): about 5% of a small model's update (benchmarks/README.md, ``floors``). Anything
    else (DeepSpeed, XLA, Megatron, accelerate's FSDP, a scaler) keeps accelerate's wrappers."""
    from accelerate.utils import DistributedType

    return (accelerator.scaler is None and accelerator.gradient_accumulation_steps == 1
            and accelerator.distributed_type in (DistributedType.NO, DistributedType.MULTI_CPU,
                                                 DistributedType.MULTI_GPU))


def is_sharded() -> bool:
    """True when models are FSDP-sharded: ``model.sharding: fsdp`` with several ranks (one process has
    nothing to shard over and runs exactly as ``ddp``)."""
    return _sharding == "fsdp" and is_distributed()


# --- the trained model: DDP (through accelerate) or FSDP2 (the FSDP2 section below) ---------------
# Under DDP the gradient all-reduce happens in backward(); under FSDP2 every forward and backward
# gathers each block's weights and backward reduce-scatters its gradients.


def shard(model: torch.nn.Module, forward_methods: Sequence[str] = (), weights: Any = None) -> torch.nn.Module:
    """FSDP: shard ``model`` in place (each transformer block, then the root; ``forward_methods`` run the
    model like ``forward``, e.g. ``generate``). DDP: unchanged. Called for the policy BEFORE its
    optimizer is created (the optimizer must hold the shards) and for the frozen reference.

    This is also where the compute dtype is chosen (``train.mixed_precision: bf16``): the weights, their
    gradients' reduction and the optimizer state stay in the stored dtype (``model.dtype``, float32 by
    default), and ``forward`` and ``forward_methods`` compute in bfloat16: FSDP2 through its
    ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` (each gathered unit is cast once),
    otherwise through ``torch.autocast`` around each of those methods. Log-probs, ratios, KL,
    advantages and losses are computed in float32 by ``ops`` either way.

    ``weights`` (FSDP only): ``model`` was built empty (its parameters on the meta device,
    ``models.load_models(empty=True)``) and this is where its values are (an object with
    ``full_state_dict(model)``, e.g. ``models.weights.InitialWeights``). Once sharded, each rank allocates
    its own shards, rank 0 alone reads the whole state dict, and each rank receives its slices of it."""
    if is_sharded():
        model = _fsdp_shard(model, forward_methods, _compute_dtype)
        if weights is not None:
            _fsdp_load_from_rank0(model, weights)
        return model
    if weights is not None:
        raise RuntimeError("a model built empty (load_models(empty=True)) is loaded only into shards: "
                           "model.sharding: fsdp with several processes")
    if _compute_dtype is not None:
        _autocast_methods(model, ("forward", *forward_methods), _compute_dtype)
    return model


def _autocast_methods(model: torch.nn.Module, methods: Sequence[str], dtype: torch.dtype) -> None:
    """Run ``model``'s ``methods`` under ``torch.autocast(dtype)`` (instance attributes, so DDP's wrapper,
    which calls ``model(...)``, runs them too). The device is this rank's, not the model's: the ``lora``
    reference has no parameters of its own (it runs the policy's LM), yet must compute as the policy does."""
    device_type = _accelerator.device.type
    for name in methods:
        def run(*args: Any, _fn: Callable[..., Any] = getattr(model, name), **kwargs: Any) -> Any:
            with torch.autocast(device_type, dtype=dtype):
                return _fn(*args, **kwargs)

        setattr(model, name, run)


def prepare(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[torch.nn.Module, Any]:
    """Wrap for data parallelism (DDP when there are several ranks; unchanged at world size 1 and under
    FSDP, where ``shard`` already did the work)."""
    if is_sharded():
        return model, optimizer
    if _plain_torch:  # the optimizer stays torch's own (see _is_plain); the model is DDP-wrapped as before
        return _accelerator.prepare_model(model), optimizer
    return _accelerator.prepare(model, optimizer)


def gathered(*models: torch.nn.Module) -> Any:
    """Context in which the models' weights are whole on every rank (FSDP: one all-gather per unit on
    entry, resharded on exit; DDP: nothing to do). Stages whose forward count may differ between
    ranks (generation, rollout scoring, eval) run inside it, so they contain no collective. A model that
    runs another's weights (the ``shared`` / ``lora`` reference runs the policy's LM) is gathered
    together with it; contexts must not nest over the same model (the inner exit would reshard it)."""
    if not is_sharded():
        return contextlib.nullcontext()
    return _fsdp_gathered(*models)


def backward(loss: torch.Tensor) -> None:
    """Backward pass; under DDP it all-reduces (averages) the gradients unless inside ``no_sync``;
    under FSDP it reduce-scatters (averages) them into each rank's shard."""
    if is_sharded() or _plain_torch:  # DDP's all-reduce runs in the module's backward hooks either way
        loss.backward()
    else:
        _accelerator.backward(loss)


def no_sync(model: torch.nn.Module) -> Any:
    """Context in which backward() only accumulates gradients locally (gradient accumulation)."""
    if is_sharded():
        return _fsdp_no_sync(model)
    return _accelerator.no_sync(model)


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the (already synchronised) gradients; returns the norm before clipping (a 0-dim tensor:
    reading it is left to the caller's one host sync per step). Under FSDP the norm is of the whole
    gradient (the shards' partial norms are all-reduced), the same number DDP reports."""
    if is_sharded():
        return _fsdp_clip_grad_norm(model, max_norm)
    if _plain_torch:
        return _clip_grad_norm(list(model.parameters()), max_norm)
    return _accelerator.clip_grad_norm_(model.parameters(), max_norm)


def _clip_grad_norm(params: list[Any], max_norm: float) -> Any:
    """What ``Accelerator.clip_grad_norm_`` computes for plain (non-DTensor) parameters, op for op, so
    the norm and the clipped gradients are bit-identical to it: the total 2-norm of the gradients, its
    norm once more over a one-element stack (as accelerate groups parameters by device mesh), then
    ``clip_grads_with_norm_`` unless ``max_norm`` is infinite."""
    from torch.nn.utils import clip_grads_with_norm_, get_total_norm

    with_grad = [p for p in params if p.grad is not None]
    norm = get_total_norm([p.grad for p in with_grad], 2.0) if with_grad else None
    total = torch.linalg.vector_norm(torch.stack([norm]) if norm is not None else torch.zeros(1), 2.0)
    if max_norm != float("inf") and with_grad:
        clip_grads_with_norm_(with_grad, max_norm, total)
    return total


def local_nbytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes these tensors hold on this rank: a ``DTensor`` (FSDP) counts its local shard; tensors sharing
    storage (tied embeddings) count once. No collective: works without a process group."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        local, key = _local_storage(t)
        if key is not None:  # (an empty tensor holds no bytes)
            if key in seen:
                continue
            seen.add(key)
        total += local.numel() * local.element_size()
    return total


def _local_storage(t: Any) -> tuple[Any, int | None]:
    """This rank's part of ``t`` (a ``DTensor``'s local shard, else ``t``) and its storage's address, the
    key under which tensors sharing storage (tied embeddings) are the same; None when it holds nothing."""
    from torch.distributed.tensor import DTensor

    local = t.to_local() if isinstance(t, DTensor) else t
    if not isinstance(local, torch.Tensor) or not local.numel():
        return local, None
    return local, local.untyped_storage().data_ptr()


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """Collective under FSDP: the whole model state dict on rank 0 (CPU, gathered unit by unit), an
    empty dict elsewhere. None when the model is not sharded (every rank already holds all of it)."""
    if not is_sharded():
        return None
    return _fsdp_full_state_dict(model)


# ``save_sharded`` / ``load_sharded`` (the FSDP checkpoint files, used by checkpoint.py only under FSDP)
# are at the end of the FSDP2 section below.


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
    flag = torch.tensor([signum], dtype=torch.int64, device=_device())
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


# --- FSDP2 ----------------------------------------------------------------------------------------
# ``model.sharding: fsdp``: sharded models, gathered generation, sharded checkpoints. Everything here is
# PyTorch's own engine: ``torch.distributed.fsdp.fully_shard`` (FSDP2, parameters as ``DTensor`` shards
# over a 1-D device mesh of all ranks), ``torch.distributed.checkpoint`` (DCP) for the sharded
# checkpoints, ``torch.distributed.checkpoint.state_dict`` for (full or sharded) state dicts. Only the
# public wrappers above and ``save_sharded`` / ``load_sharded`` call into it; above ``dist`` and
# ``checkpoint`` nothing knows whether a model is sharded (DESIGN.md). The FSDP / DCP submodules are
# imported inside the functions: a ddp run never pays for them.
#
# How a model is sharded (``_fsdp_shard``): every transformer block (the classes a Hugging Face model
# lists in ``_no_split_modules``, e.g. ``GPT2Block``, ``LlamaDecoderLayer``, ``T5Block``) is one FSDP
# unit, and the module itself (embeddings, final norm, LM head, value head) is the root unit; all with
# ``reshard_after_forward=True``, the root included (FSDP2 leaves the root gathered after forward by
# default, a good guess for training but wrong for the frozen reference, which has no backward that
# would reshard it: it would stay fully gathered for the rest of the run). The optimizer is created
# after ``shard``, so its state is created from, and sharded like, the ``DTensor`` parameters.
#
# Forward passes gather each block's weights just before the block runs and free them after (one
# all-gather per unit per forward, one more per unit in backward, one reduce-scatter per unit for the
# gradients). That makes every forward a collective: every rank must run the same number of them. The
# update loop does (``config.make_batch_plan`` refuses plans where ranks would take different numbers
# of micro-batches); the rollout and eval stages do not (a rank can have no sample in a chunk round,
# and ``generate`` stops when this rank's samples are done), so there the model is gathered once for
# the whole call instead (``gathered``): one all-gather per unit, then no collective until it is
# resharded.


def _block_classes(module: torch.nn.Module) -> set[str]:
    """Names of the transformer-block classes of the Hugging Face models inside ``module``."""
    names: set[str] = set()
    for m in module.modules():
        names.update(getattr(m, "_no_split_modules", None) or [])
    return names


def _fsdp_shard(module: torch.nn.Module, forward_methods: Iterable[str] = (),
                compute_dtype: torch.dtype | None = None) -> torch.nn.Module:
    """Shard ``module`` in place with FSDP2: each transformer block, then the root. ``forward_methods``
    are methods other than ``forward`` that run the model (``generate``, ``logprobs``): FSDP2 hooks
    only ``forward``; registered methods get the root's pre/post-forward hooks too, so the first one
    called initialises FSDP from the root (a block running first would wrongly become a root)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    from .config import ConfigError  # inside: dist stays cheap to import (config pulls in yaml)

    if next(module.parameters(), None) is None:
        # Nothing of its own to shard: the `lora` reference runs the policy's LM with the adapter off.
        # What it reads is the policy's, gathered with the policy (``gathered(policy, reference)``).
        return module
    names = _block_classes(module)
    blocks = [m for m in module.modules() if type(m).__name__ in names]
    if not blocks:
        raise ConfigError(
            f"model.sharding: fsdp cannot find the transformer blocks of {type(module).__name__}: its model "
            f"declares no `_no_split_modules`. Use model.sharding: ddp")
    # The policy's forward returns slices (logits and values at the response positions); FSDP2 warns
    # that an in-place op on such a view would skip its pre-backward hook. Nothing modifies them in
    # place (the loss math is out of place), so the warning, printed by every rank, is noise here.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    device = next(module.parameters()).device
    if device.type == "meta":  # built empty: its shards are allocated after sharding, on this rank's device
        device = _device()
    mesh = init_device_mesh(device.type, (tdist.get_world_size(),))
    mp = (MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32) if compute_dtype is not None
          else MixedPrecisionPolicy())
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=True, mp_policy=mp)
    fully_shard(module, mesh=mesh, reshard_after_forward=True, mp_policy=mp)
    for name in forward_methods:
        register_fsdp_forward_method(module, name)
    return module


def _fsdp_load_from_rank0(module: torch.nn.Module, weights: Any) -> None:
    """Fill a sharded ``module`` built empty: allocate this rank's shards (``to_empty``), then rank 0 reads
    the whole state dict (``weights.full_state_dict``) and broadcasts it one tensor at a time, each rank
    keeping its slices (``set_model_state_dict`` with ``broadcast_from_rank0``; torchtitan and
    accelerate's FSDP2 ``cpu_ram_efficient_loading`` load this way). Other ranks never hold more than
    their shards and the one tensor in flight; rank 0 holds the whole state dict it read until the load
    ends (once per model: the reference, then the policy)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    device = _device()
    # to_empty replaces every tensor, buffers included, with uninitialised memory. The buffers were
    # built with their values (models/weights.py) and some are in no state dict (Llama's rotary
    # inv_freq is non-persistent), so they are put back rather than loaded.
    kept = [(m, name, b) for m in module.modules() for name, b in m._buffers.items() if b is not None and not b.is_meta]
    module.to_empty(device=device)
    for m, name, b in kept:
        m._buffers[name] = b.to(device)
    # Agreed before the broadcast: if rank 0 cannot read a file (I/O error, out of memory) every rank
    # raises the same error here, instead of the others waiting in the broadcast for a peer that left.
    full = agree(lambda: weights.full_state_dict(module) if tdist.get_rank() == 0 else {}, ModelWeightsError)
    # The parameters are real now (no meta), so the load copies into them in place: tied parameters stay
    # one tensor, and the optimizer created afterwards holds these very shards.
    set_model_state_dict(module, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


def _fsdp_units(module: torch.nn.Module) -> list[Any]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def _fsdp_gathered(*modules: torch.nn.Module) -> Iterator[None]:
    """Every unit of ``modules`` all-gathered once on entry and kept whole until exit: the forwards
    inside (a whole ``generate`` loop, a rollout scoring pass) run without any collective, so ranks may
    run different numbers of them (or none). Costs one full copy of each module while inside."""
    units = [u for m in modules for u in _fsdp_units(m)]
    for u in units:
        u.set_reshard_after_forward(False, recurse=False)
        u.unshard()
    try:
        yield
    finally:
        for u in units:
            u.reshard()
            u.set_reshard_after_forward(True, recurse=False)


@contextlib.contextmanager
def _fsdp_no_sync(module: torch.nn.Module) -> Iterator[None]:
    """Gradient accumulation: backward keeps this rank's (unsharded) gradients, no reduce-scatter;
    the next backward outside reduces the accumulated sum (FSDP2's ``no_sync``)."""
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


def _fsdp_clip_grad_norm(module: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the sharded gradients by their global norm; returns the norm (a plain 0-dim tensor).
    ``get_total_norm`` over ``DTensor`` shards is a partial result; ``full_tensor()`` all-reduces it
    into the norm of the whole gradient, which is what DDP's clipping sees (torchtitan does the same)."""
    from torch.distributed.tensor import DTensor

    params = [p for p in module.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def _fsdp_dedupe(sd: dict[str, Any]) -> dict[str, Any]:
    """Drop every key whose tensor shares storage with an earlier key's (tied embeddings): safetensors
    refuses shared tensors, and loading the first key fills the tied one too."""
    out, seen = {}, set()
    for k, v in sd.items():
        _, key = _local_storage(v)
        if key is not None:
            if key in seen:
                continue
            seen.add(key)
        out[k] = v
    return out


def _fsdp_flat(model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> dict[str, torch.Tensor]:
    """One flat dict of tensors for DCP: ``model.<fqn>`` and ``optim.<fqn>.<state key>``. The optimizer's
    param groups (plain numbers) go to JSON beside it, so the DCP files hold tensors only."""
    flat = {f"model.{k}": v for k, v in _fsdp_dedupe(model_sd).items()}
    for fqn, st in optim_sd["state"].items():
        for k, v in st.items():
            if not isinstance(v, torch.Tensor):
                raise TypeError(f"optimizer state {fqn}.{k} is a {type(v).__name__}, not a tensor")
            flat[f"optim.{fqn}.{k}"] = v
    return flat


def _fsdp_full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Collective: the whole (unsharded) model state dict on rank 0, on CPU, gathered one unit at a
    time (``cpu_offload``), so rank 0 holds at most one full copy; an empty dict on the other ranks."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # Gathered tensors are separate copies; tied parameters (GPT-2's head and input embeddings) become
    # one tensor again, so save_pretrained sees the tie and writes the matrix once.
    first: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if name in full and id(p) in first:
            full[name] = full[first[id(p)]]
        first.setdefault(id(p), name)
    return full


def save_sharded(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Collective (FSDP only): every rank writes its shards of the model and optimizer state into
    ``path`` (one safetensors file per rank, with DCP's shard offsets in its header: torch's
    ``HuggingFaceStorageWriter``, so nothing is pickled). Returns the optimizer's param groups (JSON)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save(_fsdp_flat(model_sd, optim_sd),
             storage_writer=HuggingFaceStorageWriter(path, save_distributed=True))
    return optim_sd["param_groups"]


def load_sharded(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 param_groups: list[dict[str, Any]]) -> None:
    """Collective (FSDP only): restore model and optimizer from ``save_sharded``'s files. DCP reads each
    rank's slices from whichever files hold them, so the saving and loading shardings may differ."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    # get_state_dict creates the optimizer's state (a zero-lr step) when it has none yet: the tensors
    # DCP loads into, with this run's shapes and sharding.
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.load(_fsdp_flat(model_sd, optim_sd), storage_reader=HuggingFaceStorageReader(path))
    set_state_dict(model, optimizer, model_state_dict=model_sd,
                   optim_state_dict={"state": optim_sd["state"], "param_groups": param_groups})
