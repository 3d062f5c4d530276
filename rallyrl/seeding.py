"""Seeding and RNG isolation.

Every random stream is derived from ``train.seed`` by one function, ``stream_seed(seed, name, rank)``,
which lists the streams and says why each is shared or per-rank (style rule 7):
- **shared** for what must be identical on every rank: model and value-head initialisation (DDP also
  broadcasts rank 0's weights, but identical init keeps single- and multi-process runs comparable) and
  the global prompt order;
- **per-rank** for what must differ: sampling during generation and minibatch shuffling. If every rank
  sampled with the same stream, ranks given the same prompt would produce the same response.

``isolated_rng()`` saves and restores every global RNG (python ``random``, numpy, torch CPU and all CUDA
devices) around user code such as a reward function. This is the reproducibility guarantee from trlx
PR #305: a reward pipeline that draws random numbers must not shift the training streams, so training
is bit-identical whether, where and how often the reward runs.
"""

from __future__ import annotations

import contextlib
import random
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

def stream_seed(seed: int, stream: str, rank: int | None = None, iteration: int | None = None) -> int:
    """The seed of one named random stream: the ONE derivation every stream uses.

    ``rank=None`` gives a shared stream (identical on every rank); an int gives that rank's own stream.
    ``iteration`` (per-rank streams only) re-derives a rank's stream as of that iteration: a run resumed
    on another number of processes has no saved state for its ranks' streams, so it starts them here
    (see ``docs/checkpoints.md``). Without it the derivation is the one every run starts with.
    Mixing through numpy's ``SeedSequence`` (not ``seed + k``) keeps streams of nearby seeds, ranks and
    names statistically independent: seed 1 / rank 0 never equals seed 0 / rank 1.

    The streams (and why each is shared or per-rank):
    - ``model_init`` (shared): any random init inside ``from_pretrained`` (missing weights) matches on
      every rank, so single- and multi-process runs start from the same model.
    - ``value_head`` (shared): value-head initialisation, independent of the global RNG.
    - ``prompt_order`` (shared): every rank must agree which prompt is global sample ``i``, so each
      takes its own shard and nothing is drawn twice.
    - ``sampling`` (per rank): generation; ranks given the same prompt must not sample the same response.
    - ``minibatch`` (per rank): each rank's minibatch order over its own samples.
    - ``engine_sampling`` / ``engine_eval`` (per rank): the base seeds of a separate generation engine's
      own sampler (``generation.engine: vllm``) for training rollouts and for eval; each request's seed
      is derived from it, the weight version and the call's place since the last weight push
      (rollout/vllm.py), so a resumed run asks for the same seeds as the uninterrupted one.
    """
    if iteration is not None and rank is None:
        raise ValueError("stream_seed: only a per-rank stream is re-derived at an iteration")
    salt = zlib.crc32(stream.encode())
    # The entropy's length tells the three kinds apart: [seed, salt] shared, [.., rank+1] per rank,
    # [.., rank+1, iteration+1] per rank re-derived at an iteration (never equal to a start-of-run stream).
    entropy = ([seed % (2**63), salt] + ([] if rank is None else [rank + 1])
               + ([] if iteration is None else [iteration + 1]))
    return int(np.random.SeedSequence(entropy).generate_state(1, dtype=np.uint64)[0] >> 1)


def stream_generator(seed: int, stream: str, rank: int | None = None) -> torch.Generator:
    """A torch generator for one named stream (see ``stream_seed``)."""
    return torch.Generator().manual_seed(stream_seed(seed, stream, rank))


def seed_everything(seed: int, rank: int, iteration: int | None = None) -> None:
    """Seed the global RNGs (python, numpy, torch CPU and every CUDA device) with this rank's
    ``sampling`` stream (re-derived at ``iteration`` if given: see ``stream_seed``). Every other stream
    uses an explicit generator from ``stream_generator``."""
    s = stream_seed(seed, "sampling", rank, iteration)
    random.seed(s)
    np.random.seed(s % (2**32))
    torch.manual_seed(s)


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
