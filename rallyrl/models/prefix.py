"""A repeated prompt computed once in the scoring and training forwards (``model.prefill_once``).

The G members of a group share one prompt, and a batch of the scoring pass or a training micro-batch
holds several copies of it. Instead of running B whole ``[query | response]`` sequences, each distinct
query runs once and its copies reuse the result: a causal LM runs the D distinct queries' first Q - 1
tokens with a KV cache, the cache is expanded to the B rows by index (differentiable: the gradients of
every copy flow back into the one prompt forward), and the B rows run ``[last query token | response]``
against it (``causal.shared_causal_forward``); a seq2seq LM encodes the D distinct queries once and
expands the encoder output (``seq2seq``). Logits, hidden states, and so log-probs, values, loss and
gradients equal the full forward's within float rounding (tests/smoke/test_prefill_once_train.py).

This module holds what both need: which rows share a query, whether a model's cache can be used this
way, and the two cache layers. Shapes: ``B`` rows, ``D`` distinct queries, ``Q`` (left-padded) query
length, ``L`` cached length.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

Rows = tuple[torch.Tensor, torch.Tensor]  # (D,) a row holding each distinct query; (B,) each row's distinct query


def distinct_queries(query: torch.Tensor, query_mask: torch.Tensor) -> Rows | None:
    """For the B rows of a left-padded batch: one row index per distinct query (D,), the lowest row
    holding it, and for each row the position of its query among them (B,); None when no query repeats
    (nothing to share). Queries are compared on their real tokens (pads as -1), so a pad id that is also
    a real token id cannot merge two different queries."""
    key = query.masked_fill(~query_mask.bool(), -1)  # (B, Q)
    uniq, expand = torch.unique(key, dim=0, return_inverse=True)  # (D, Q), (B,)
    D, B = uniq.shape[0], key.shape[0]
    if D == B:
        return None
    rows = torch.arange(B, device=query.device)
    firsts = torch.full((D,), B, device=query.device).scatter_reduce(0, expand, rows, "amin")  # (D,)
    return firsts, expand


def causal_prefix_supported(lm: nn.Module) -> bool:
    """Whether ``lm`` can run ``causal.shared_causal_forward``: its forward takes a cache object, and the
    cache transformers builds for its config is made of plain full-attention layers (``DynamicLayer``),
    whose behaviour the two layers below reproduce. Sliding-window, linear-attention and other cache
    layouts, and models that take no cache argument, run the full forward."""
    try:
        from transformers.cache_utils import DynamicCache, DynamicLayer
    except ImportError:  # a transformers without cache layers
        return False
    if cache_kwarg(lm) is None:
        return False
    try:
        layers = DynamicCache(config=lm.config).layers
    except Exception:  # a config transformers cannot lay a cache out for
        return False
    return all(type(layer) is DynamicLayer for layer in layers)


def cache_kwarg(lm: nn.Module) -> str | None:
    """The name of the cache argument of ``lm``'s forward: ``cache`` (transformers 5) or
    ``past_key_values`` (before); None if it takes neither."""
    base = lm.get_base_model() if hasattr(lm, "get_base_model") else lm  # a PEFT model passes kwargs through
    params = _forward_params(getattr(base.forward, "__func__", base.forward))
    return "cache" if "cache" in params else "past_key_values" if "past_key_values" in params else None


@functools.lru_cache(maxsize=None)
def _forward_params(forward: Callable[..., Any]) -> frozenset[str]:
    """The parameter names of a model class's ``forward`` (the function: one answer per class, cached,
    as ``inspect.signature`` costs ~0.1 ms per call)."""
    return frozenset(inspect.signature(forward).parameters)


def recording_cache() -> Any:
    """An empty cache for the prefix pass: each layer keeps the keys and values of its last ``update``."""
    from transformers.cache_utils import Cache

    return Cache(layer_class_to_replicate=_layer_classes()[0])


def expanded_cache(recorded: Any, expand: torch.Tensor) -> Any:
    """The prefix pass's (D, ...) keys and values expanded to the B rows (row i gets its query's; an
    index, so the gradient of every copy reaches the one computation), as a read-only cache."""
    from transformers.cache_utils import Cache

    prefixed = _layer_classes()[1]
    return Cache(layers=[prefixed(layer.keys[expand], layer.values[expand]) for layer in recorded.layers])


@functools.lru_cache(maxsize=None)
def _layer_classes() -> tuple[type, type]:
    """The two cache layers (defined on first use: transformers is imported only when a model runs).

    Neither grows in place. Activation checkpointing (``base.checkpoint_activations``) runs a block's
    forward a second time in backward; with transformers' own ``DynamicLayer`` that second ``update``
    would append the keys again and the recomputed attention would read a cache twice as long. Here the
    recording layer overwrites (a recomputation writes what the first pass wrote) and the prefixed layer
    never stores (a recomputation reads the same prefix)."""
    from transformers.cache_utils import DynamicLayer

    class Recording(DynamicLayer):
        """The prefix pass: stores the last keys and values and attends over exactly them (it starts
        from an empty cache)."""

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
                   **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            self.keys, self.values = key_states, value_states  # (D, heads, L, head_dim)
            return key_states, value_states

    class Prefixed(DynamicLayer):
        """The response pass: the expanded prefix (B, heads, L, head_dim), read-only; ``update`` returns
        prefix + new keys and values without storing them. Its length is what the model's mask and
        positions count as already seen."""

        def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
            super().__init__()
            self.lazy_initialization(keys, values)
            self.keys, self.values = keys, values

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
                   **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.cat([self.keys, key_states], -2), torch.cat([self.values, value_states], -2)

    return Recording, Prefixed
