"""Generation, stop-sequence truncation and the log-prob/value pass, producing ``Rollouts``.

Shapes: ``B`` samples on this rank, ``Q`` query length (left-padded), ``T`` response length
(right-padded), ``V`` vocab. ``response_mask`` is True for real response tokens (one mask convention).

We train on exactly the sampled token ids. The text handed to the reward function is the decoding of
those same ids; it is never re-tokenized for training (trlx re-tokenized decoded text, so its reward
model saw a different ending than the tokens that were trained on).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from . import ops
from .config import GenerationConfig
from .models import PolicyWithValueHead, reference_logits


@dataclass
class Generated:
    """Raw generation output of one chunk on one rank."""

    query_ids: list[list[int]]
    response_ids: list[list[int]]  # after EOS / stop-sequence truncation; EOS kept (it is an action)
    outputs: list[str]  # decode(response_ids) without special tokens


@dataclass
class Rollouts:
    """One rank's training batch for an iteration (tensors on CPU or the training device)."""

    query_ids: torch.Tensor  # (B, Q) left-padded with pad_id
    query_mask: torch.Tensor  # (B, Q) bool
    response_ids: torch.Tensor  # (B, T) right-padded with pad_id
    response_mask: torch.Tensor  # (B, T) bool
    logprobs: torch.Tensor  # (B, T) of the sampling policy (temperature applied)
    ref_logprobs: torch.Tensor  # (B, T) of the frozen reference
    values: torch.Tensor  # (B, T)
    scores: torch.Tensor  # (B,) scalar reward, placed on the last real token
    dense_scores: torch.Tensor | None  # (B, T) per-token reward, or None when no sample has one
    prompts: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    metadata: list[dict[str, Any]] = field(default_factory=list)
    global_index: list[int] = field(default_factory=list)
    reward_components: list[dict[str, float]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.prompts)

    def total_rewards(self) -> torch.Tensor:
        """(B,) each sample's whole reward: the scalar score plus its dense per-token rewards."""
        dense = self.dense_scores.sum(1).double() if self.dense_scores is not None else 0.0
        return self.scores.double() + dense  # float64: the logged value is the exact sum of the two parts


def _pad(seqs: list[list[int]], pad_id: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    width = max((len(x) for x in seqs), default=0)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.bool)
    for i, x in enumerate(seqs):
        cols = slice(width - len(x), width) if left else slice(0, len(x))
        ids[i, cols] = torch.tensor(x, dtype=torch.long)
        mask[i, cols] = True
    return ids, mask


def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, Q) ids and mask, padded on the left (prompts: every response starts at the same column)."""
    return _pad(seqs, pad_id, left=True)


def right_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) ids and mask, padded on the right (responses)."""
    return _pad(seqs, pad_id, left=False)


def truncate_at_stop(ids: list[int], tokenizer: Any, stop_sequences: list[str]) -> list[int]:
    """Keep the shortest prefix whose decoding contains a stop sequence (the tokens completing it are
    kept: emitting the stop is what the policy should learn). Unchanged if no stop sequence occurs.

    "Prefix decoding contains a stop string" is monotone in the prefix length, so a binary search needs
    O(log T) decodes instead of T.
    """
    if not stop_sequences:
        return ids

    def has_stop(k: int) -> bool:
        text = tokenizer.decode(ids[:k], skip_special_tokens=True)
        return any(s in text for s in stop_sequences)

    if not has_stop(len(ids)):
        return ids
    lo, hi = 1, len(ids)  # has_stop(hi) is True
    while lo < hi:
        mid = (lo + hi) // 2
        if has_stop(mid):
            hi = mid
        else:
            lo = mid + 1
    return ids[:lo]


@torch.no_grad()
def generate(
    lm: torch.nn.Module,
    tokenizer: Any,
    query_ids: list[list[int]],
    gen: GenerationConfig,
    do_sample: bool,
    device: torch.device,
) -> Generated:
    """Sample responses for one chunk of prompts with HF ``generate`` (KV cache on)."""
    if not query_ids:
        return Generated([], [], [])
    ids, mask = left_pad(query_ids, tokenizer.pad_token_id)
    kwargs: dict[str, Any] = dict(
        max_new_tokens=gen.max_new_tokens,
        do_sample=do_sample,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        use_cache=True,
    )
    if do_sample:
        kwargs.update(temperature=gen.temperature, top_k=gen.top_k or None, top_p=gen.top_p)
    else:
        kwargs.update(temperature=None, top_k=None, top_p=None)
    # We always pass the attention mask, but generate() drops an all-ones one, after which the pads of
    # finished rows make transformers warn about a missing mask; that warning does not apply here.
    hf_log = logging.getLogger("transformers.modeling_utils")
    level = hf_log.level
    hf_log.setLevel(logging.ERROR)
    try:
        out = lm.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **kwargs)
    finally:
        hf_log.setLevel(level)
    responses = out[:, ids.shape[1] :].tolist()  # (B, T') as lists
    eos = tokenizer.eos_token_id
    kept: list[list[int]] = []
    for r in responses:
        if eos is not None and eos in r:
            # Keep EOS: choosing to stop is an action with a reward. What follows is generate()'s padding.
            r = r[: r.index(eos) + 1]
        r = truncate_at_stop(r, tokenizer, gen.stop_sequences)
        kept.append(r or [eos if eos is not None else tokenizer.pad_token_id])
    outputs = [tokenizer.decode(r, skip_special_tokens=True) for r in kept]
    return Generated(query_ids=[list(q) for q in query_ids], response_ids=kept, outputs=outputs)


@torch.no_grad()
def score_tokens(
    policy: PolicyWithValueHead,
    ref: torch.nn.Module,
    query_ids: list[list[int]],
    response_ids: list[list[int]],
    pad_id: int,
    temperature: float,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """One forward of the policy (log-probs + values) and one of the reference (log-probs)."""
    q, qm = left_pad(query_ids, pad_id)
    r, rm = right_pad(response_ids, pad_id)
    ids = torch.cat([q, r], 1).to(device)  # (B, Q+T)
    mask = torch.cat([qm, rm], 1).to(device)  # (B, Q+T)
    T = r.shape[1]
    logits, values = policy(ids, mask, T)  # (B, T, V), (B, T)
    labels = r.to(device)
    # Temperature is part of the sampling policy, so log-probs (and the KL) are of the scaled logits,
    # in the rollout pass and in training alike (as in TRL).
    logprobs = ops.logprobs_from_logits(logits.float() / temperature, labels)  # (B, T)
    ref_lp = ops.logprobs_from_logits(reference_logits(ref, ids, mask, T).float() / temperature, labels)
    rm = rm.to(device)
    return {
        "query_ids": q,
        "query_mask": qm,
        "response_ids": r,
        "response_mask": rm.cpu(),
        "logprobs": (logprobs * rm).cpu(),
        "ref_logprobs": (ref_lp * rm).cpu(),
        "values": (values.float() * rm).cpu(),
    }
