"""Seeding and RNG isolation.

Why two kinds of seed (style rule 7):
- **Shared seed** (``seed``) for what must be identical on every rank: model and value-head
  initialisation (DDP also broadcasts rank 0's weights, but identical init keeps single- and
  multi-process runs comparable) and the global prompt order (every rank must agree which prompt is
  sample ``i`` so each takes its own shard and nothing is drawn twice).
- **Per-rank seed** for what must differ: sampling during generation and minibatch shuffling. If every
  rank sampled with the same stream, ranks given the same prompt would produce the same response.

``isolated_rng()`` saves and restores every global RNG (python ``random``, numpy, torch CPU and all CUDA
devices) around user code such as a reward function. This is the reproducibility guarantee from trlx
PR #305: a reward pipeline that draws random numbers must not shift the training streams, so training
is bit-identical whether, where and how often the reward runs.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

# Large odd multiplier so per-rank seeds of nearby base seeds do not collide (seed 1 rank 0 vs seed 0 rank 1).
_RANK_STRIDE = 1_000_003


def rank_seed(seed: int, rank: int) -> int:
    return (seed + _RANK_STRIDE * (rank + 1)) % (2**63 - 1)


def seed_everything(seed: int, rank: int) -> None:
    """Seed the global RNGs with the per-rank seed (sampling streams). Shared draws use explicit
    generators created from ``seed`` (see ``shared_generator``)."""
    s = rank_seed(seed, rank)
    random.seed(s)
    np.random.seed(s % (2**32))
    torch.manual_seed(s)  # also seeds every CUDA device


def shared_generator(seed: int, *salt: int) -> torch.Generator:
    """A torch generator that is identical on every rank (for initialisation)."""
    g = torch.Generator()
    g.manual_seed(int(np.random.SeedSequence([seed, *salt]).generate_state(1, dtype=np.uint64)[0] >> 1))
    return g


def get_rng_state() -> dict[str, Any]:
    """Every global RNG state of this process (tensors and plain Python objects; no pickled code)."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # Only this process's own device: reading every GPU's state would create a CUDA context on each
        # of them (in a 7+1 set-up, on the reward GPU from every rank). Training draws only from its own
        # device, and that stream is what must not move.
        dev = torch.cuda.current_device()
        state["cuda"] = (dev, torch.cuda.get_rng_state(dev))
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        dev, cuda_state = state["cuda"]
        torch.cuda.set_device(dev)  # a reward function may have switched the current device
        torch.cuda.set_rng_state(cuda_state, dev)


@contextlib.contextmanager
def isolated_rng() -> Iterator[None]:
    """Run a block without letting it change any global RNG stream of the caller."""
    state = get_rng_state()
    try:
        yield
    finally:
        set_rng_state(state)
