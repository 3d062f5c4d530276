"""Atomic checkpoints and exact resume.

A checkpoint is a folder ``run_dir/checkpoints/step_<N>/``:

    policy.safetensors        policy + value-head weights (tied weights handled by safetensors)
    optimizer.safetensors     optimizer tensors (Adam moments, step counters)
    optimizer.json            the rest of the optimizer state (param groups), tensors by reference
    trainer_state.json        iteration, optimizer steps, LR scheduler, KL controller, running reward
                              moments, prompt-sampler position, world size
    rng_rank<R>.safetensors   rank R's RNG states (torch CPU/CUDA, minibatch-shuffle generator)
    rng_rank<R>.json          rank R's python and numpy RNG states
    manifest.json             size and sha256 of every file above; written last

With ``model.sharding: fsdp`` the weights and optimizer tensors are written by every rank, each its own
shards, with PyTorch's distributed checkpointing (DCP, through ``dist.save_sharded``), instead of
``policy.safetensors`` and ``optimizer.safetensors``:

    sharded/shard-<R+1>-model-00001-of-00001.safetensors   rank R's shards of the policy + value head
                              weights and of the optimizer tensors, their offsets in the header
                              (torch's HuggingFaceStorageWriter: safetensors, nothing pickled)
    optimizer.json            the optimizer's param groups (numbers; tensors are in sharded/)

DCP reads each rank's slices from whichever files hold them, so it does not depend on which rank wrote
what. The manifest covers these files as it covers the others.

Why it is built this way:
- **Atomic**: everything is written into ``.tmp_step_<N>``, flushed and fsynced, and only then renamed to
  ``step_<N>``. A crash mid-save leaves a ``.tmp_*`` folder that is never read, never a half-written
  checkpoint under a final name.
- **Verifiable**: the manifest's checksums detect truncated, missing or corrupted files; a checkpoint
  without a valid manifest is refused with an error naming what is wrong.
- **Safe to load**: only safetensors and JSON are read; nothing is unpickled.
- **Exact**: every piece of state that influences later iterations is saved, including each rank's RNG
  streams, so a resumed run is the same run (final weights bit-identical on CPU). On another number of
  processes the rank streams are re-derived instead (everything else carries over): the run continues,
  but not bit-identically.

On several nodes, ``train.run_dir`` must be on storage shared by all nodes (every rank writes its RNG
state into the checkpoint folder).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, load_model, save_file, save_model

from .. import dist
from ..errors import CheckpointError, writing
from ..seeding import get_rng_state, set_rng_state

FORMAT_VERSION = 1
SHARDED_DIR = "sharded"  # model.sharding: fsdp: the DCP files (dist.save_sharded), one per rank
_STEP_RE = re.compile(r"^step_(\d+)$")


# ------------------------------------------------------------------------------------------------
# Nested state <-> (JSON, tensors): lets optimizer/RNG state go to safetensors + JSON without pickle


def split_tensors(obj: Any, prefix: str = "") -> tuple[Any, dict[str, torch.Tensor]]:
    tensors: dict[str, torch.Tensor] = {}

    def walk(o: Any, path: str) -> Any:
        if isinstance(o, torch.Tensor):
            tensors[path] = o.detach().cpu().contiguous()
            return {"__tensor__": path}
        if isinstance(o, dict):
            # JSON keys are strings; remember int keys (optimizer state is keyed by param index)
            return {"__dict__": [[k, walk(v, f"{path}.{k}")] for k, v in o.items()]}
        if isinstance(o, (list, tuple)):
            return {"__list__" if isinstance(o, list) else "__tuple__": [walk(v, f"{path}.{i}") for i, v in enumerate(o)]}
        if isinstance(o, np.ndarray):
            return {"__ndarray__": o.tolist(), "dtype": str(o.dtype)}
        if isinstance(o, (np.integer, np.floating)):
            return o.item()
        if o is None or isinstance(o, (bool, int, float, str)):
            return o
        raise CheckpointError(f"cannot checkpoint a {type(o).__name__} at {path or '<root>'}")

    return walk(obj, prefix or "t"), tensors


def join_tensors(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__dict__" in obj:
            return {k: join_tensors(v, tensors) for k, v in obj["__dict__"]}
        if "__list__" in obj:
            return [join_tensors(v, tensors) for v in obj["__list__"]]
        if "__tuple__" in obj:
            return tuple(join_tensors(v, tensors) for v in obj["__tuple__"])
        if "__ndarray__" in obj:
            return np.array(obj["__ndarray__"], dtype=obj["dtype"])
    return obj


# ------------------------------------------------------------------------------------------------
# files


def _fsync_write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_json(path: Path, obj: Any) -> None:
    _fsync_write(path, json.dumps(obj, indent=1).encode())


def _save_split(base: Path, obj: Any) -> None:
    meta, tensors = split_tensors(obj)
    save_file(tensors, str(base.with_suffix(".safetensors")))
    _fsync_file(base.with_suffix(".safetensors"))
    _write_json(base.with_suffix(".json"), meta)


def _load_split(base: Path) -> Any:
    meta = json.loads(base.with_suffix(".json").read_text())
    tensors = load_file(str(base.with_suffix(".safetensors")))
    return join_tensors(meta, tensors)


# ------------------------------------------------------------------------------------------------
# RNG state of this rank


def rank_rng_state(shuffle_gen: torch.Generator) -> dict[str, Any]:
    """Every RNG stream of this rank: the global ones (``seeding.get_rng_state``) and the minibatch
    shuffle generator. ``split_tensors`` stores the tuples and arrays in it without pickling."""
    return {"global": get_rng_state(), "shuffle": shuffle_gen.get_state()}


def restore_rank_rng_state(state: dict[str, Any], shuffle_gen: torch.Generator) -> None:
    set_rng_state(state["global"])
    shuffle_gen.set_state(state["shuffle"])


# ------------------------------------------------------------------------------------------------
# save


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


@dist.stage("checkpoint save")
def save_checkpoint(
    run_dir: Path,
    step: int,
    policy: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict[str, Any],
    shuffle_gen: torch.Generator,
    keep_last: int,
) -> Path:
    """Collective: every rank calls it. Each I/O phase runs through ``dist.agree``, so a failure on any
    rank (disk full, permissions) raises the same ``CheckpointError`` on every rank instead of leaving
    the others in a barrier; nothing is renamed to ``step_<N>`` unless every file was written."""
    root = checkpoint_dir(run_dir)
    tmp, final = root / f".tmp_step_{step}", root / f"step_{step}"
    what = f"saving checkpoint {final}"

    def io(fn: Any) -> Any:
        """``fn`` with its I/O failures as one line (path, OS reason, hint; ``errors.writing``)."""
        def run() -> Any:
            with writing(tmp, what, note="the last complete checkpoint is intact"):
                return fn()
        return run

    sharded = dist.is_sharded()
    param_groups: list[Any] = []
    dist.agree(io(lambda: _start(root, tmp)), CheckpointError, main_only=True, what=what)
    dist.agree(io(lambda: _save_split(tmp / f"rng_rank{dist.rank()}", rank_rng_state(shuffle_gen))),
               CheckpointError, what=what)
    if sharded:
        dist.agree(io(lambda: param_groups.extend(_save_shards(tmp, policy, optimizer))), CheckpointError, what=what)
    state = {**trainer_state, "world_size": dist.world_size(), "sharding": "fsdp" if sharded else "ddp",
             "format": FORMAT_VERSION}
    optimizer_state = (lambda: {"param_groups": param_groups}) if sharded else optimizer.state_dict
    dist.agree(io(lambda: _finish(tmp, final, step, None if sharded else policy, optimizer_state, state, keep_last)),
               CheckpointError, main_only=True, what=what)
    return final


def _start(root: Path, tmp: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    if tmp.exists():
        shutil.rmtree(tmp)  # left over from a crash during an earlier save
    tmp.mkdir()


def _save_shards(tmp: Path, policy: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[Any]:
    """Every rank: its shards of the weights and optimizer state; returns the optimizer's param groups."""
    param_groups = dist.save_sharded(str(tmp / SHARDED_DIR), policy, optimizer)
    for f in (tmp / SHARDED_DIR).iterdir():
        if f.name.startswith(f"shard-{dist.rank() + 1:05d}-"):
            _fsync_file(f)
    return param_groups


def _finish(tmp: Path, final: Path, step: int, policy: torch.nn.Module | None, optimizer_state: Any,
            trainer_state: dict[str, Any], keep_last: int) -> None:
    """Main rank: the weights (``policy``; None when sharded: they are in ``sharded/``), the optimizer
    state, the trainer state and the manifest, then the rename to ``step_<N>`` and the pruning."""
    if policy is None:
        _fsync_dir(tmp / SHARDED_DIR)
    else:
        save_model(policy, str(tmp / "policy.safetensors"))
        _fsync_file(tmp / "policy.safetensors")
    _save_split(tmp / "optimizer", optimizer_state())
    _write_json(tmp / "trainer_state.json", trainer_state)
    files = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
    manifest = {"format": FORMAT_VERSION, "step": step,
                "files": {n: {"size": (tmp / n).stat().st_size, "sha256": _sha256(tmp / n)} for n in files}}
    _write_json(tmp / "manifest.json", manifest)
    _fsync_dir(tmp)
    root = final.parent
    if final.exists():  # re-saving a step (e.g. after a resume): replace atomically enough
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    _prune(root, keep_last)


def list_checkpoints(root: Path) -> list[Path]:
    """Checkpoint folders under ``root`` (``step_<N>``), oldest first (not verified)."""
    return [p for _, p in _steps(root)]


def _steps(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    out = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_RE.match(p.name)) and p.is_dir()]
    return sorted(out)


def _prune(root: Path, keep_last: int) -> None:
    for _, p in _steps(root)[:-keep_last]:
        shutil.rmtree(p, ignore_errors=True)


# ------------------------------------------------------------------------------------------------
# verify / find / load


def verify_checkpoint(path: Path, checksums: bool = True) -> dict[str, Any]:
    """Check the manifest and every file's size and (``checksums``) sha256; returns the manifest or raises
    ``CheckpointError`` naming the checkpoint and the file. Without checksums no file is read whole: the
    quick look ``RunDir.check_start`` takes on every rank before anything heavy."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint not found: {path}")
    mpath = path / "manifest.json"
    if not mpath.is_file():
        raise CheckpointError(f"checkpoint {path} is incomplete: manifest.json is missing")
    try:
        manifest = json.loads(mpath.read_text())
        files = manifest["files"]
        sizes = {name: info["size"] for name, info in files.items()}
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"checkpoint {path}: manifest.json is corrupt ({e})") from None
    for name, info in files.items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint {path} is incomplete: {name} is missing")
        if f.stat().st_size != sizes[name]:
            raise CheckpointError(
                f"checkpoint {path}: {name} has {f.stat().st_size} bytes, the manifest says {sizes[name]} (truncated?)"
            )
        if checksums and _sha256(f) != info["sha256"]:
            raise CheckpointError(f"checkpoint {path}: checksum mismatch in {name} (file is corrupt)")
    return manifest


def checkpoint_problem(path: Path, checksums: bool = True) -> str | None:
    """What ``verify_checkpoint`` finds wrong with ``path`` (its message), or None for a valid checkpoint."""
    try:
        verify_checkpoint(path, checksums)
    except CheckpointError as e:
        return str(e)
    return None


def newest_valid(root: Path, checksums: bool = True) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest valid checkpoint under ``root`` (None if there is none) and each newer one with what is
    wrong with it, newest first."""
    problems: list[tuple[Path, str]] = []
    for _, p in reversed(_steps(root)):
        problem = checkpoint_problem(p, checksums)
        if problem is None:
            return p, problems
        problems.append((p, problem))
    return None, problems


def resolve_resume(run_dir: Path, resume: str) -> Path:
    """``latest`` -> the newest valid checkpoint (newer invalid ones are skipped: ``newest_valid`` says
    which and why); else the checkpoint folder ``resume``, verified."""
    if resume != "latest":
        p = Path(resume)
        verify_checkpoint(p)
        return p
    root = checkpoint_dir(run_dir)
    if not _steps(root):
        raise CheckpointError(f"train.resume=latest: no checkpoint in {root}")
    newest, problems = newest_valid(root)
    if newest is None:
        raise CheckpointError(f"train.resume=latest: no valid checkpoint in {root} ({'; '.join(m for _, m in problems)})")
    return newest


def load_checkpoint(
    path: Path, policy: torch.nn.Module, optimizer: torch.optim.Optimizer, shuffle_gen: torch.Generator
) -> dict[str, Any]:
    """Restore weights, optimizer and this rank's RNG; returns the trainer state dict.

    A checkpoint written by another number of processes restores everything but the RNG streams: the
    weights, optimizer, schedule and trainer state are the same on every rank (replicated under DDP),
    but rank R's saved streams belong to a different split of the batch (and a new rank has none). The
    caller re-derives them (``trainer._resume``; the run is then not bit-identical to an uninterrupted
    one, and says so)."""
    state = json.loads((path / "trainer_state.json").read_text())
    saved_sharding, sharded = state.get("sharding", "ddp"), dist.is_sharded()
    if saved_sharding != ("fsdp" if sharded else "ddp"):
        raise CheckpointError(
            f"checkpoint {path} holds a {saved_sharding} checkpoint; this run uses "
            f"{'fsdp' if sharded else 'ddp'} (model.sharding; fsdp on one process runs as ddp): resume it with "
            f"the model.sharding it was written with")
    if sharded:
        # DCP reshards: each rank reads its slices from whichever files hold them, so the checkpoint
        # may come from another number of processes.
        groups = _load_split(path / "optimizer")["param_groups"]
        dist.agree(lambda: dist.load_sharded(str(path / SHARDED_DIR), policy, optimizer, groups),
                   CheckpointError, what=f"loading checkpoint {path}")
    else:
        missing, unexpected = load_model(policy, str(path / "policy.safetensors"), strict=True)
        optimizer.load_state_dict(_load_split(path / "optimizer"))
    if state["world_size"] == dist.world_size():
        restore_rank_rng_state(_load_split(path / f"rng_rank{dist.rank()}"), shuffle_gen)
    return state
