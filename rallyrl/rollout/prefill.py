"""A group's prompt computed once in generation (``generation.prefill_once``).

The G members of a group share one prompt. Instead of prefilling every copy, each distinct prompt of a
``generate`` call is prefilled once (causal: its KV cache; seq2seq: its encoder output) and expanded to its
copies by index. Greedy decoding gives the same tokens and sampling the same distribution
(tests/smoke/test_prefill_once.py); docs/scaling.md has the speed-up.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..models.causal import logits_to_keep


def prompt_index(query_ids: list[list[int]]) -> list[int] | None:
    """For each query, the index of the first query with the same tokens; None when no query repeats
    (then there is nothing to prefill once)."""
    first: dict[tuple[int, ...], int] = {}
    index = [first.setdefault(tuple(q), i) for i, q in enumerate(query_ids)]
    return index if len(first) < len(index) else None


def distinct_rows(prompt_index: torch.Tensor | None, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """From ``prompt_index`` (B,) (each row's first row with the same query): the distinct rows to
    prefill (D,), ascending, and for each row its position among them (B,), to expand a (D, ...) result
    to (B, ...) with one index; None when there is nothing to share (no index, or no row repeats)."""
    if prompt_index is None:
        return None
    firsts, expand = torch.unique(prompt_index.to(device), return_inverse=True)
    return (firsts, expand) if len(firsts) < len(prompt_index) else None


def shared_prefill(lm: nn.Module, query: torch.Tensor, query_mask: torch.Tensor,
                   prompt_index: torch.Tensor | None) -> dict[str, Any]:
    """``generate`` kwargs that prefill each distinct query once: the KV cache of every query's first
    Q - 1 tokens, computed on the D distinct rows and expanded to the B rows by index
    (``Cache.batch_select_indices``); {} for the ordinary path.

    The last query token is left out of the cache on purpose: generate() then runs it as its first
    decoding step, on the whole batch, exactly where it would have taken the first token's logits from
    the prefill (a cache as long as the input leaves generate() nothing to run). Positions and mask are
    the ones generate() itself derives from the left-padded mask, so the cached keys are the same
    numbers the ordinary prefill would cache (up to float rounding of a smaller batch). One-token
    queries, a batch without repeats and a model whose cache has no batch index (not a ``DynamicCache``)
    take the ordinary path."""
    rows = distinct_rows(prompt_index, query.device)
    if rows is None or query.shape[1] < 2:
        return {}
    firsts, expand = rows
    ids, mask = query[firsts, :-1], query_mask[firsts, :-1]  # (D, Q-1)
    position_ids = (mask.long().cumsum(-1) - 1).masked_fill(~mask.bool(), 1)  # as generate() derives them
    out = lm(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=True,
             **logits_to_keep(lm, 1))  # the logits are not used: compute one column
    # transformers 5 calls the cache `cache` (the old name still works, with a deprecation warning)
    name = "cache" if out.get("cache") is not None else "past_key_values"
    cache = out.get(name)
    if cache is None or not hasattr(cache, "batch_select_indices"):
        return {}
    cache.batch_select_indices(expand)  # (D, ...) -> (B, ...): row i holds its query's cache
    return {name: cache}


def shared_encoding(lm: nn.Module, query: torch.Tensor, query_mask: torch.Tensor,
                    prompt_index: torch.Tensor | None) -> dict[str, Any]:
    """``generate`` kwargs that encode each distinct query once: the encoder's output on the D distinct
    rows, expanded to the B rows by index (generate() skips its own encoder pass when given
    ``encoder_outputs``); {} for the ordinary path (no repeated query). A row's encoding depends on that
    row alone, so every row gets what its own encoding would be (up to float rounding of a smaller
    batch); the attention mask of all B rows still goes to generate()."""
    rows = distinct_rows(prompt_index, query.device)
    if rows is None:
        return {}
    firsts, expand = rows
    enc = lm.get_encoder()(input_ids=query[firsts], attention_mask=query_mask[firsts], return_dict=True)
    enc["last_hidden_state"] = enc.last_hidden_state[expand]  # (D, Q, H) -> (B, Q, H)
    return {"encoder_outputs": enc}
