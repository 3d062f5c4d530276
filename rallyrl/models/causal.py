"""Causal LMs (``AutoModelForCausalLM``): the policy with a value head and the full-copy reference.

A causal LM sees ``[left-padded query | right-padded response]`` as one sequence; that concatenation
happens here and nowhere else.
"""

from __future__ import annotations

import functools
import inspect
from pathlib import Path
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .. import ops
from .base import (distinct_rows, frozen_copy, last_position_states, lm_save_kwargs, quiet_generate,
                   scored_from_generation, value_head_or_none)


class CausalPolicy(nn.Module):
    """A causal LM plus a scalar value head on its last hidden state (one forward gives both); ``head``
    None: no value head at all (critic-free estimators), ``forward`` gives values None."""

    def __init__(self, lm: nn.Module, value_head_std: float, seed: int, head: str | None = "linear",
                 save: Callable[..., None] | None = None) -> None:
        super().__init__()
        self.lm = lm
        # how final/ is written when the LM is not a plain transformers model (LoRA):
        # save(lm, out, state_dict=None | the whole policy state dict when the parameters are shards)
        self._save = save
        self.v_head = value_head_or_none(lm.config.get_text_config().hidden_size, head, value_head_std, seed,
                                         next(lm.parameters()).dtype)

    def forward(self, query: torch.Tensor, query_mask: torch.Tensor, response: torch.Tensor,
                response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        T = response.shape[1]
        out = causal_forward(self.lm, query, query_mask, response, response_mask,
                             hidden_states=self.v_head is not None)
        logits = out.logits[:, -(T + 1) : -1]  # (B, T, V): position t-1 predicts response token t
        if self.v_head is None:
            return logits, None
        hidden = out.hidden_states[-1][:, -(T + 1) : -1]  # (B, T, H)
        return logits, self.v_head(hidden).squeeze(-1)  # (B, T, V), (B, T)

    @torch.no_grad()
    def generate(self, query: torch.Tensor, query_mask: torch.Tensor, prompt_index: torch.Tensor | None = None,
                 **sampling: Any) -> torch.Tensor:
        cache = shared_prefill(self.lm, query, query_mask, prompt_index)
        return quiet_generate(self.lm, query, query_mask, **cache, **sampling)[:, query.shape[1] :]  # (B, T')

    @torch.no_grad()
    def generate_scored(self, query: torch.Tensor, query_mask: torch.Tensor, score_temperature: float,
                        prompt_index: torch.Tensor | None = None,
                        **sampling: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        # Before the hook below: the prefill's states choose no response token.
        cache = shared_prefill(self.lm, query, query_mask, prompt_index)
        # The LM head's input is the final hidden state forward() puts the value head on
        # (hidden_states[-1]); generate() computes it at each step anyway.
        head_input = self.lm.get_output_embeddings() if self.v_head is not None else None
        with last_position_states(head_input, of_input=True) as states:
            out = quiet_generate(self.lm, query, query_mask, return_dict_in_generate=True, output_logits=True,
                                 **cache, **sampling)
        ids = out.sequences[:, query.shape[1] :]  # (B, T')
        return ids, *scored_from_generation(ids, out.logits, states, self.v_head, score_temperature)

    def save_pretrained(self, out: Path, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """``state_dict``: this policy's whole state dict (``lm.*``, ``v_head.*``) when the module's own
        parameters are shards (FSDP assembles it on the main rank); the LM part is what is written."""
        if self._save is not None:
            self._save(self.lm, Path(out), state_dict=state_dict)
        else:
            self.lm.save_pretrained(out, safe_serialization=True, **lm_save_kwargs(state_dict))


class CopyReference(nn.Module):
    """The reference as a full frozen copy of the initial causal LM (trlx / TRL default)."""

    reads_policy = False  # its own weights only: under fsdp it is gathered alone

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = frozen_copy(lm)

    @torch.no_grad()
    def logprobs(self, query: torch.Tensor, query_mask: torch.Tensor, response: torch.Tensor,
                 response_mask: torch.Tensor, temperature: float) -> torch.Tensor:
        T = response.shape[1]
        logits = causal_forward(self.lm, query, query_mask, response, response_mask, hidden_states=False).logits
        return ops.logprobs_from_logits(logits[:, -(T + 1) : -1].float() / temperature, response)  # (B, T)


def shared_prefill(lm: nn.Module, query: torch.Tensor, query_mask: torch.Tensor,
                   prompt_index: torch.Tensor | None) -> dict[str, Any]:
    """``generate`` kwargs that prefill each distinct query once (``generation.prefill_once``): the KV
    cache of every query's first Q - 1 tokens, computed on the D distinct rows and expanded to the B
    rows by index (``Cache.batch_select_indices``); {} for the ordinary path.

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
             **_logits_to_keep(lm, 1))  # the logits are not used: compute one column
    # transformers 5 calls the cache `cache` (the old name still works, with a deprecation warning)
    name = "cache" if out.get("cache") is not None else "past_key_values"
    cache = out.get(name)
    if cache is None or not hasattr(cache, "batch_select_indices"):
        return {}
    cache.batch_select_indices(expand)  # (D, ...) -> (B, ...): row i holds its query's cache
    return {name: cache}


def causal_forward(lm: nn.Module, query: torch.Tensor, query_mask: torch.Tensor, response: torch.Tensor,
                   response_mask: torch.Tensor, hidden_states: bool) -> Any:
    """The causal-LM forward both passes share, on [left-padded query | right-padded response]. Left
    padding shifts the real tokens, so positions count real tokens only (as generate() does); only the
    last T + 1 logits are computed where the model supports it."""
    ids = torch.cat([query, response], 1)  # (B, Q+T)
    mask = torch.cat([query_mask, response_mask], 1)  # (B, Q+T)
    position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, Q+T)
    return lm(input_ids=ids, attention_mask=mask, position_ids=position_ids, output_hidden_states=hidden_states,
              use_cache=False, **_logits_to_keep(lm, response.shape[1] + 1))


def _logits_to_keep(lm: nn.Module, n: int) -> dict[str, int]:
    """``{"logits_to_keep": n}`` (only the last n positions' logits are computed) where ``lm`` accepts it."""
    base = lm.get_base_model() if hasattr(lm, "get_base_model") else lm  # a PEFT model passes kwargs through
    return {"logits_to_keep": n} if _takes_logits_to_keep(getattr(base.forward, "__func__", base.forward)) else {}


@functools.lru_cache(maxsize=None)
def _takes_logits_to_keep(forward: Callable[..., Any]) -> bool:
    """Whether a model's ``forward`` (the function, so the answer is per class) accepts ``logits_to_keep``.
    Cached: ``inspect.signature`` costs ~0.1 ms, a few % of a small model's scoring pass (benchmarks/README.md, floors)."""
    return "logits_to_keep" in inspect.signature(forward).parameters
