"""Models built without their weights, for ``model.sharding: fsdp``: loading straight into shards.

Loading the usual way (``from_pretrained`` on every rank, then sharding) makes every rank hold the whole
model, and a second whole copy for the ``copy`` reference, before any of it is sharded: the start-up peak
of every rank is two to three full models however many ranks share them (three on SmolLM2-135M,
docs/scaling.md). Here instead:

1. every rank builds the LM from its ``config.json`` with its parameters on the meta device (no memory,
   no initialisation; accelerate's ``init_empty_weights``), and the policy and reference trees around it
   (``loading.load_models``: the reference's deep copy of a meta LM is free);
2. ``dist.shard`` shards each model while it is empty, allocates this rank's shards (``to_empty``) and
   fills them: rank 0 alone reads the weights (``InitialWeights.full_state_dict``) and PyTorch's
   ``set_model_state_dict(..., full_state_dict=True, broadcast_from_rank0=True)`` sends every rank its
   slices, one tensor at a time.

Rank 0 then peaks at about one whole model (the state dict it read) plus its shards; every other rank at
its shards plus the largest single tensor in flight (the embedding matrix).

Buffers are built for real (``include_buffers=False``): the non-persistent ones (Llama's rotary
``inv_freq``) are in no state dict, so no load would refill them; ``dist.shard`` puts them back after
``to_empty``. The value head is built for real too (its seeded initialisation, ``base.make_value_head``,
is the same on every rank) and its tensors travel with the LM's in rank 0's state dict.

When the folder cannot be read this way the LM is loaded the usual way and a note says why
(``empty_lm``): no safetensors files (``*.bin`` or GGUF weights), or names or shapes that transformers
would have to convert while loading (old checkpoints, renamed layers). Only what ``from_pretrained``
would do by plain copying is done here, so both ways give the same weights (tests/dist/test_fsdp_load.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn


@dataclass
class InitialWeights:
    """Where the initial values of models built empty come from: for each LM state-dict key, a tensor in
    the folder's safetensors files (``files``: key -> (file, key in it)); for every other key of the policy
    or reference (``lm.`` is the LM's prefix in both), a tensor built in memory at load time (the seeded
    value head, a persistent buffer the files lack)."""

    files: dict[str, tuple[Path, str]]
    in_memory: dict[str, torch.Tensor] = field(default_factory=dict)

    def full_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """The whole initial state dict of ``module`` (the policy or the copy reference, built empty and
        possibly sharded already), each tensor in the dtype of the parameter it fills. Reads every
        weight file: called on one rank only. Keys tied to the same file tensor (tied embeddings) get
        one shared tensor."""
        from safetensors import safe_open

        wanted = {k: v.dtype for k, v in module.state_dict(keep_vars=True).items()}
        out: dict[str, torch.Tensor] = {}
        by_file: dict[Path, list[tuple[str, str]]] = {}
        for key in wanted:
            if key in self.in_memory:
                out[key] = self.in_memory[key].detach().to(wanted[key])
            elif key.startswith("lm.") and key[3:] in self.files:
                path, name = self.files[key[3:]]
                by_file.setdefault(path, []).append((key, name))
            else:  # load_models built both; a key neither knows is a bug, not a user error
                raise KeyError(f"no initial value for {key} of {type(module).__name__}")
        for path, keys in by_file.items():
            read: dict[tuple[str, torch.dtype], torch.Tensor] = {}
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for key, name in keys:
                    dtype = wanted[key]
                    if (name, dtype) not in read:
                        read[name, dtype] = f.get_tensor(name).to(dtype)
                    out[key] = read[name, dtype]
        return out


def safetensors_files(folder: Path) -> list[Path] | None:
    """The weight files ``from_pretrained`` would read: ``model.safetensors``, else the files listed in
    ``model.safetensors.index.json``; None when the folder has neither."""
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / n for n in names]
    return None


def empty_lm(auto: Any, path: str, dtype: torch.dtype) -> tuple[nn.Module | None, InitialWeights | None, str]:
    """The LM of ``path`` built with its parameters on the meta device (buffers real), and where each of
    its state-dict entries is read from; or (None, None, why) when the folder cannot be read straight into
    shards, in which case the caller loads it the usual way."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, GenerationConfig

    folder = Path(path)
    files = safetensors_files(folder)
    if files is None:
        return None, None, (f"{folder} has no model.safetensors or model.safetensors.index.json (re-save the model "
                            f"with save_pretrained() to load it straight into shards)")
    config = AutoConfig.from_pretrained(path)
    with init_empty_weights(include_buffers=False):
        lm = auto.from_config(config, dtype=dtype)
    # init_empty_weights moves each parameter to meta as it is registered, as a new Parameter: the tie the
    # model made while being built (head = embedding matrix) became two tensors; tie them again.
    lm.tie_weights()
    lm.config.name_or_path = path  # as from_pretrained
    if lm.can_generate() and (folder / "generation_config.json").is_file():
        # from_pretrained reads it too: sampling defaults and special tokens generate() uses
        lm.generation_config = GenerationConfig.from_pretrained(path)

    mapped, in_memory, problem = _map_state(lm, files)
    if problem:
        return None, None, f"the weights in {folder} need the conversions of from_pretrained ({problem})"
    return lm, InitialWeights(mapped, in_memory), ""


def _map_state(lm: nn.Module, files: list[Path]) -> tuple[dict[str, tuple[Path, str]], dict[str, torch.Tensor], str]:
    """Where each state-dict entry of the empty ``lm`` is read from (file, saved name), the persistent
    buffers the files lack (kept at their built values, as from_pretrained does), and what does not map
    ("" when everything does)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for name in st.keys():
                shapes[name] = (f, tuple(st.get_slice(name).get_shape()))
    prefix = getattr(lm, "base_model_prefix", "") or ""
    state = lm.state_dict(keep_vars=True)
    mapped: dict[str, tuple[Path, str]] = {}
    in_memory: dict[str, torch.Tensor] = {}
    wrong: list[str] = []
    for key, t in state.items():
        # the key as saved by save_pretrained, or (older checkpoints) without / with the base model's prefix
        candidates = [key]
        if prefix and key.startswith(prefix + "."):
            candidates.append(key[len(prefix) + 1 :])
        elif prefix:
            candidates.append(f"{prefix}.{key}")
        name = next((c for c in candidates if c in shapes), None)
        if name is not None and shapes[name][1] == tuple(t.shape):
            mapped[key] = (shapes[name][0], name)
        elif name is not None:
            wrong.append(f"{name} {list(shapes[name][1])} vs {list(t.shape)}")
    # tied parameters (an LM head sharing the embedding matrix) are saved once, under one of their names
    names_of: dict[int, list[str]] = {}
    for name, p in lm.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
    for names in names_of.values():
        found = next((mapped[n] for n in names if n in mapped), None)
        for n in names:
            if found is not None and n not in mapped and n in state:
                mapped[n] = found
    missing = []
    for key, t in state.items():
        if key in mapped:
            continue
        if not t.is_meta:  # a persistent buffer the files lack: from_pretrained keeps its built value too
            in_memory[f"lm.{key}"] = t.detach()
        else:
            missing.append(key)
    if not (missing or wrong):
        return mapped, in_memory, ""
    what = (f"shapes differ: {', '.join(wrong[:3])}" if wrong else
            f"not in its safetensors files under these names: {', '.join(missing[:3])}")
    return mapped, in_memory, what + (", ..." if len(wrong or missing) > 3 else "")
