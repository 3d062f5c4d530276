"""``model.sharding: fsdp``: sharded models, gathered generation, sharded checkpoints (FSDP2 and DCP).

Everything here is PyTorch's own engine: ``torch.distributed.fsdp.fully_shard`` (FSDP2, parameters as
``DTensor`` shards over a 1-D device mesh of all ranks), ``torch.distributed.checkpoint`` (DCP) for the
sharded checkpoints, ``torch.distributed.checkpoint.state_dict`` for (full or sharded) state dicts. Only
the public wrappers of ``accelerator.py`` (``shard``, ``gathered``, ``no_sync``, ``clip_grad_norm``,
``full_state_dict``) and ``save_sharded`` / ``load_sharded`` (``checkpoint.py``, under FSDP only) call
into it; above ``dist`` and ``checkpoint`` nothing knows whether a model is sharded (DESIGN.md). The
engine's own collectives (FSDP2's hooks, DCP, the state-dict helpers) run inside those submodules; this
module calls none of ``torch.distributed``'s collectives itself (``collectives.py`` does:
tests/unit/test_dist_boundary.py). The FSDP / DCP submodules are imported inside the functions: a ddp
run never pays for them.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

from ..errors import ModelWeightsError
from .collectives import agree, collective_device, rank, torch, world_size

# How a model is sharded (``shard_module``): every transformer block (the classes a Hugging Face model
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


def shard_module(module: torch.nn.Module, forward_methods: Iterable[str] = (),
                compute_dtype: torch.dtype | None = None) -> torch.nn.Module:
    """Shard ``module`` in place with FSDP2: each transformer block, then the root. ``forward_methods``
    are methods other than ``forward`` that run the model (``generate``, ``logprobs``): FSDP2 hooks
    only ``forward``; registered methods get the root's pre/post-forward hooks too, so the first one
    called initialises FSDP from the root (a block running first would wrongly become a root)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    from ..config import ConfigError  # inside: dist stays cheap to import (config pulls in yaml)

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
        device = collective_device()
    mesh = init_device_mesh(device.type, (world_size(),))
    mp = (MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32) if compute_dtype is not None
          else MixedPrecisionPolicy())
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=True, mp_policy=mp)
    fully_shard(module, mesh=mesh, reshard_after_forward=True, mp_policy=mp)
    for name in forward_methods:
        register_fsdp_forward_method(module, name)
    return module


def load_from_rank0(module: torch.nn.Module, weights: Any) -> None:
    """Fill a sharded ``module`` built empty: allocate this rank's shards (``to_empty``), then rank 0 reads
    the whole state dict (``weights.full_state_dict``) and broadcasts it one tensor at a time, each rank
    keeping its slices (``set_model_state_dict`` with ``broadcast_from_rank0``; torchtitan and
    accelerate's FSDP2 ``cpu_ram_efficient_loading`` load this way). Other ranks never hold more than
    their shards and the one tensor in flight; rank 0 holds the whole state dict it read until the load
    ends (once per model: the reference, then the policy)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    device = collective_device()
    # to_empty replaces every tensor, buffers included, with uninitialised memory. The buffers were
    # built with their values (models/weights.py) and some are in no state dict (Llama's rotary
    # inv_freq is non-persistent), so they are put back rather than loaded.
    kept = [(m, name, b) for m in module.modules() for name, b in m._buffers.items() if b is not None and not b.is_meta]
    module.to_empty(device=device)
    for m, name, b in kept:
        m._buffers[name] = b.to(device)
    # Agreed before the broadcast: if rank 0 cannot read a file (I/O error, out of memory) every rank
    # raises the same error here, instead of the others waiting in the broadcast for a peer that left.
    full = agree(lambda: weights.full_state_dict(module) if rank() == 0 else {}, ModelWeightsError)
    # The parameters are real now (no meta), so the load copies into them in place: tied parameters stay
    # one tensor, and the optimizer created afterwards holds these very shards.
    set_model_state_dict(module, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


def _units(module: torch.nn.Module) -> list[Any]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def gathered(*modules: torch.nn.Module) -> Iterator[None]:
    """Every unit of ``modules`` all-gathered once on entry and kept whole until exit: the forwards
    inside (a whole ``generate`` loop, a rollout scoring pass) run without any collective, so ranks may
    run different numbers of them (or none). Costs one full copy of each module while inside."""
    units = [u for m in modules for u in _units(m)]
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
def no_sync(module: torch.nn.Module) -> Iterator[None]:
    """Gradient accumulation: backward keeps this rank's (unsharded) gradients, no reduce-scatter;
    the next backward outside reduces the accumulated sum (FSDP2's ``no_sync``)."""
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


def clip_grad_norm(module: torch.nn.Module, max_norm: float) -> torch.Tensor:
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


def _dedupe(sd: dict[str, Any]) -> dict[str, Any]:
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


def _flat(model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> dict[str, torch.Tensor]:
    """One flat dict of tensors for DCP: ``model.<fqn>`` and ``optim.<fqn>.<state key>``. The optimizer's
    param groups (plain numbers) go to JSON beside it, so the DCP files hold tensors only."""
    flat = {f"model.{k}": v for k, v in _dedupe(model_sd).items()}
    for fqn, st in optim_sd["state"].items():
        for k, v in st.items():
            if not isinstance(v, torch.Tensor):
                raise TypeError(f"optimizer state {fqn}.{k} is a {type(v).__name__}, not a tensor")
            flat[f"optim.{fqn}.{k}"] = v
    return flat


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
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
    dcp.save(_flat(model_sd, optim_sd),
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
    dcp.load(_flat(model_sd, optim_sd), storage_reader=HuggingFaceStorageReader(path))
    set_state_dict(model, optimizer, model_state_dict=model_sd,
                   optim_state_dict={"state": optim_sd["state"], "param_groups": param_groups})
