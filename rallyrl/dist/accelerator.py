"""The trained model's data parallelism: the ``accelerate.Accelerator`` (and so the process group), and
what the trainer does to the model through it: ``shard``, ``prepare``, ``gathered``, ``backward``,
``no_sync``, ``clip_grad_norm``, ``full_state_dict``.

``model.sharding: ddp`` (and every one-process run) goes through accelerate's DDP, or through plain torch
where accelerate would add nothing but Python (``_is_plain``); ``model.sharding: fsdp`` with several
ranks hands each of these over to the FSDP2 engine in ``sharding.py``. Above ``dist`` and ``checkpoint``
nothing knows which one runs (DESIGN.md).
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Callable, Sequence
from typing import Any

from . import sharding as fsdp  # (not `sharding`: init_accelerator's argument has that name)
from .collectives import is_distributed, set_timeout, torch

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
    global _accelerator, _sharding, _compute_dtype, _plain_torch
    _sharding = sharding
    set_timeout(timeout_s)
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


# --- the trained model: DDP (through accelerate) or FSDP2 (sharding.py) --------------------------
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
        model = fsdp.shard_module(model, forward_methods, _compute_dtype)
        if weights is not None:
            fsdp.load_from_rank0(model, weights)
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
    return fsdp.gathered(*models)


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
        return fsdp.no_sync(model)
    return _accelerator.no_sync(model)


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the (already synchronised) gradients; returns the norm before clipping (a 0-dim tensor:
    reading it is left to the caller's one host sync per step). Under FSDP the norm is of the whole
    gradient (the shards' partial norms are all-reduced), the same number DDP reports."""
    if is_sharded():
        return fsdp.clip_grad_norm(model, max_norm)
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


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """Collective under FSDP: the whole model state dict on rank 0 (CPU, gathered unit by unit), an
    empty dict elsewhere. None when the model is not sharded (every rank already holds all of it)."""
    if not is_sharded():
        return None
    return fsdp.full_state_dict(model)
