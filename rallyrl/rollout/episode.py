"""Episodes: the loop that turns prompts into finished episodes by calling a generation engine.

Today an episode is a single turn (prompt -> one response), the default environment; a multi-turn
environment plugs in here. Whatever the environment, the trained tokens of every assistant turn are
exactly the ids the engine sampled (token-in, token-out): the text handed to the reward function is
the decoding of those same ids, never re-tokenized for training (trlx re-tokenized decoded text, so its
reward model saw a different ending than the tokens that were trained on).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .padding import pad
from .engine import GenerationEngine, SamplingSpec


@dataclass
class Episodes:
    """One chunk round's finished episodes on one rank: padded once, here, and used as is downstream.

    Shapes: ``B`` episodes, ``Q`` query length (left-padded), ``T`` response length (right-padded). The
    two masks are those of ``Rollouts`` (rollout/batch.py): ``response_mask`` what the model sees,
    ``action_mask`` what the policy sampled."""

    query_ids: torch.Tensor  # (B, Q) left-padded
    query_mask: torch.Tensor  # (B, Q) bool
    response_ids: torch.Tensor  # (B, T) right-padded; after EOS / stop truncation, EOS kept (an action)
    response_mask: torch.Tensor  # (B, T) bool: attention
    action_mask: torch.Tensor  # (B, T) bool: sampled by the policy (single turn: = response_mask)
    response_lists: list[list[int]]  # the same response tokens, unpadded (what the reward function sees)
    outputs: list[str]  # decode(response) without special tokens
    # rollout.logprobs_from=generate: the policy's (B, T) log-probs and values from the decoding itself
    logprobs: torch.Tensor | None = None
    values: torch.Tensor | None = None
    version: int = 0  # the engine's weight version that sampled them
    truncated: list[bool] = field(default_factory=list)  # per episode: cut by max_new_tokens (see cut_by_length)

    def __len__(self) -> int:
        return len(self.outputs)


def run_episodes(engine: GenerationEngine, tokenizer: object, query_ids: list[list[int]],
                 spec: SamplingSpec) -> Episodes:
    """Single-turn episodes for one chunk round: one response per prompt. Every rank calls it in every
    chunk round, with or without prompts (``engine.ready()`` may be a collective)."""
    with engine.ready():
        if not query_ids:  # a rank with no sample in this chunk round still enters the reward step
            empty = torch.zeros(0, 0, dtype=torch.long)
            none = torch.zeros(0, 0) if spec.logprobs else None
            return Episodes(empty, empty.bool(), empty, empty.bool(), empty.bool(), [], [], none, none,
                            engine.version)
        sampled = engine.generate(query_ids, spec)
    pad_id = tokenizer.pad_token_id  # type: ignore[attr-defined]
    q, qm = pad(query_ids, pad_id, left=True)  # (B, Q)
    r_ids, rm = pad(sampled.token_ids, pad_id, left=False)  # (B, T)
    outputs = [tokenizer.decode(r, skip_special_tokens=True) for r in sampled.token_ids]  # type: ignore[attr-defined]
    ep = Episodes(q, qm, r_ids, rm, rm.clone(), sampled.token_ids, outputs, version=sampled.version,
                  truncated=[cut_by_length(r, spec, tokenizer) for r in sampled.token_ids])
    if sampled.logprobs is not None:
        T = r_ids.shape[1]  # <= T': the cuts only shorten responses, token t stays at column t
        ep.logprobs = sampled.logprobs[:, :T].cpu() * rm  # (B, T), 0 off the actions
        ep.values = sampled.values[:, :T].cpu() * rm if sampled.values is not None else None
    return ep


def cut_by_length(ids: list[int], spec: SamplingSpec, tokenizer: Any) -> bool:
    """Whether a response ended because ``spec.max_new_tokens`` ran out rather than by choice: it has
    that many tokens, its last is not a stop token, and its text holds no stop sequence (an engine cuts
    a response after the token completing a stop sequence, so one found here was completed by the last
    token). TRL's ``is_truncated`` tests the last token against EOS and pad only."""
    if len(ids) < spec.max_new_tokens or ids[-1] in spec.stop_token_ids:
        return False
    if spec.stop_sequences:
        text = tokenizer.decode(ids, skip_special_tokens=True)
        return not any(s in text for s in spec.stop_sequences)
    return True
