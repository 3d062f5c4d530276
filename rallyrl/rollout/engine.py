"""The generation-engine seam: what the rollout asks of whatever samples the tokens.

An engine takes token-id prompts (never text) and a ``SamplingSpec`` and returns, per sequence, the
sampled token ids (cut after EOS or a stop sequence) and, when asked, the sampling log-probs. The rollout
never calls ``model.generate`` itself; it calls an engine, so a second engine (vLLM) is a second class
behind this protocol, not a change to the loop.

Weights: ``sync(policy)`` is called after every optimizer phase with the trained policy. An engine that
runs the policy's own module (``HFEngine``) has nothing to copy and only counts; an engine that holds its
own copy of the weights (vLLM) pushes them there. Either way ``version`` says which weights produced a
sample: 0 for the initial weights, +1 per ``sync``.

Collectives: ``ready()`` is entered by EVERY rank once per chunk round, with or without prompts (under
FSDP the HF engine gathers the policy's weights there, a collective); inside it ``generate`` may be
called any number of times (the turns of multi-turn episodes) with no collective, so ranks whose
episodes take different numbers of turns never wait for each other.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass(frozen=True)
class SamplingSpec:
    """How to sample one call's sequences (``generation.*`` of the config, resolved for one use).

    ``temperature`` is also the temperature of the returned log-probs when decoding greedily: the
    log-probs are those of the sampling policy (logits / temperature), as the training pass computes
    them. ``seed``: engines with their own sampler (vLLM) seed each call from it; the HF engine draws
    from the process's generation stream (``seeding.seed_everything``: per rank), so it takes None.
    """

    max_new_tokens: int
    do_sample: bool = True
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    stop_token_ids: tuple[int, ...] = ()  # end a sequence; the stop token is kept (stopping is an action)
    stop_sequences: tuple[str, ...] = ()  # strings: the sequence ends with the token that completes one
    logprobs: bool = False  # also return each sampled token's log-prob (and values, where the engine has them)
    seed: int | None = None

    @staticmethod
    def of(gen: Any, do_sample: bool, tokenizer: Any, logprobs: bool = False) -> "SamplingSpec":
        """From a ``GenerationConfig`` and the tokenizer (its EOS ends a sequence)."""
        eos = tokenizer.eos_token_id
        return SamplingSpec(max_new_tokens=gen.max_new_tokens, do_sample=do_sample, temperature=gen.temperature,
                            top_k=gen.top_k, top_p=gen.top_p, stop_token_ids=() if eos is None else (int(eos),),
                            stop_sequences=tuple(gen.stop_sequences), logprobs=logprobs)


@dataclass
class Sampled:
    """One ``generate`` call's output, one entry per prompt, in the prompts' order.

    ``token_ids[i]``: the sampled ids of sequence i, after EOS / stop-sequence truncation, never empty.
    ``logprobs`` / ``values`` (only with ``SamplingSpec.logprobs``): (B, T') tensors whose row i holds
    sequence i's per-token values in its first ``len(token_ids[i])`` columns (token t at column t; the
    columns after it are not meaningful). ``values`` only from an engine that runs the value head.
    """

    token_ids: list[list[int]]
    logprobs: torch.Tensor | None = None
    values: torch.Tensor | None = None
    version: int = 0  # the weights that produced these samples (see GenerationEngine.version)

    def __len__(self) -> int:
        return len(self.token_ids)


class GenerationEngine(Protocol):
    """What the rollout needs from a generator (see the module docstring)."""

    version: int  # 0 = the initial weights; +1 per sync()

    def ready(self) -> contextlib.AbstractContextManager[None]:
        """Context in which ``generate`` may be called (a collective on entry: every rank, every chunk
        round, with or without prompts)."""
        ...

    def generate(self, prompts: list[list[int]], spec: SamplingSpec) -> Sampled:
        """Sample one response per prompt (``prompts``: unpadded token-id lists, at least one)."""
        ...

    def sync(self, policy: Any) -> None:
        """The trained weights changed (after an optimizer phase): make the next samples come from
        ``policy``'s current weights, and count the version."""
        ...


def no_prompts(version: int, spec: SamplingSpec) -> Sampled:
    """What an engine returns for a chunk round in which this rank has no prompt."""
    none = torch.zeros(0, 0) if spec.logprobs else None
    return Sampled([], none, none, version)


@contextlib.contextmanager
def nothing_to_gather() -> Iterator[None]:
    """``ready()`` of an engine whose weights need no collective to be in place."""
    yield
