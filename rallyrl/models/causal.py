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
import torch.nn.functional as F
from torch import nn

from .. import ops
from .base import frozen_copy, lm_save_kwargs, run_as_forward, value_head_or_none
from .prefix import Rows, cache_kwarg, causal_prefix_supported, distinct_queries, expanded_cache, recording_cache


class CausalPolicy(nn.Module):
    """A causal LM plus a scalar value head on its last hidden state (one forward gives both); ``head``
    None: no value head at all (critic-free estimators), ``forward`` gives values None."""

    def __init__(self, lm: nn.Module, value_head_std: float, seed: int, head: str | None = "linear",
                 save: Callable[..., None] | None = None, prefill_once: bool = True,
                 fixed_passes: bool = False, full_when_scoring: bool = False) -> None:
        super().__init__()
        self.lm = lm
        # model.prefill_once: a query repeated in a batch runs once (models/prefix.py), where the model allows;
        # fixed_passes (model.sharding: fsdp): then every batch runs the same passes (response_outputs)
        self.prefill_once = prefill_once and causal_prefix_supported(lm)
        self.fixed_passes = fixed_passes
        # full_when_scoring (a `shared` reference, which always runs the full forward): the scoring pass
        # (no grad) runs the full forward too, so the policy and its reference compute the same logits from
        # the same weights, bit for bit (policy/kl exactly 0 before the first update); training still shares
        self.full_when_scoring = full_when_scoring
        # how final/ is written when the LM is not a plain transformers model (LoRA):
        # save(lm, out, state_dict=None | the whole policy state dict when the parameters are shards)
        self._save = save
        self.v_head = value_head_or_none(lm.config.get_text_config().hidden_size, head, value_head_std, seed,
                                         next(lm.parameters()).dtype)

    run = run_as_forward  # the generation engine's entry (models/base.py)

    def forward(self, query: torch.Tensor, query_mask: torch.Tensor, response: torch.Tensor,
                response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        share = self.prefill_once and not (self.full_when_scoring and not torch.is_grad_enabled())
        logits, hidden = response_outputs(self.lm, query, query_mask, response, response_mask,
                                          self.v_head is not None, share, self.fixed_passes)  # (B, T, V), (B, T, H)
        if self.v_head is None:
            return logits, None
        return logits, self.v_head(hidden).squeeze(-1)  # (B, T, V), (B, T)

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

    def __init__(self, lm: nn.Module, prefill_once: bool = True, fixed_passes: bool = False) -> None:
        super().__init__()
        self.lm = frozen_copy(lm)
        # as CausalPolicy, passes included: the same path on the same batch gives the policy's bits (KL 0)
        self.prefill_once = prefill_once and causal_prefix_supported(lm)
        self.fixed_passes = fixed_passes

    @torch.no_grad()
    def logprobs(self, query: torch.Tensor, query_mask: torch.Tensor, response: torch.Tensor,
                 response_mask: torch.Tensor, temperature: float) -> torch.Tensor:
        logits, _ = response_outputs(self.lm, query, query_mask, response, response_mask, False, self.prefill_once,
                                     self.fixed_passes)
        return ops.logprobs_from_logits(logits.float() / temperature, response)  # (B, T)


def response_outputs(lm: nn.Module, query: torch.Tensor, query_mask: torch.Tensor, response: torch.Tensor,
                     response_mask: torch.Tensor, hidden_states: bool, prefill_once: bool,
                     fixed_passes: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The logits predicting each response token (B, T, V) and, with ``hidden_states``, the last hidden
    state they come from (B, T, H; else None): position t-1 of ``[query | response]`` predicts response
    token t. With ``prefill_once`` and a query that repeats in the batch, each distinct query's prefix
    runs once (``shared_causal_forward``); otherwise (and for one-token queries) the full forward.

    ``fixed_passes``: with ``prefill_once``, every batch takes the two passes of ``shared_causal_forward``,
    whatever it holds (no repeat: D = B; one-token queries: behind one more, masked, pad column). Under
    ``model.sharding: fsdp`` every pass of a block gathers its weights, a collective, so every rank must
    run as many passes as the others, while which rows repeat is each rank's own."""
    T = response.shape[1]
    fixed = prefill_once and fixed_passes
    if fixed and query.shape[1] == 1:  # the prompt pass needs a column: a masked pad changes no real token
        query, query_mask = F.pad(query, (1, 0)), F.pad(query_mask, (1, 0))  # (B, 2)
    rows = distinct_queries(query, query_mask) if prefill_once and query.shape[1] > 1 else None
    if rows is None and fixed:
        every = torch.arange(query.shape[0], device=query.device)
        rows = (every, every)
    if rows is not None:
        return shared_causal_forward(lm, query, query_mask, response, response_mask, hidden_states, rows)
    out = causal_forward(lm, query, query_mask, response, response_mask, hidden_states)
    return out.logits[:, -(T + 1) : -1], out.hidden_states[-1][:, -(T + 1) : -1] if hidden_states else None


def causal_forward(lm: nn.Module, query: torch.Tensor, query_mask: torch.Tensor, response: torch.Tensor,
                   response_mask: torch.Tensor, hidden_states: bool) -> Any:
    """The causal-LM forward both passes share, on [left-padded query | right-padded response]. Left
    padding shifts the real tokens, so positions count real tokens only (as generate() does); only the
    last T + 1 logits are computed where the model supports it."""
    ids = torch.cat([query, response], 1)  # (B, Q+T)
    mask = torch.cat([query_mask, response_mask], 1)  # (B, Q+T)
    position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, Q+T)
    return lm(input_ids=ids, attention_mask=mask, position_ids=position_ids, output_hidden_states=hidden_states,
              use_cache=False, **logits_to_keep(lm, response.shape[1] + 1))


def shared_causal_forward(lm: nn.Module, query: torch.Tensor, query_mask: torch.Tensor, response: torch.Tensor,
                          response_mask: torch.Tensor, hidden_states: bool,
                          rows: Rows) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``causal_forward`` with each distinct query's first Q - 1 tokens run once (``rows``: from
    ``prefix.distinct_queries``); returns what ``response_outputs`` returns. The response pass runs
    ``[last query token | response[:-1]]``: its position t predicts response token t, exactly the T
    columns the full forward's callers keep (the last query token runs with the responses because its
    logits predict the first response token; the prefix pass computes one column of logits, unused).

    The positions are the full forward's (counted over the real tokens of ``[query | response]``), the
    cached keys and values are the full forward's for the same tokens (computed on D rows instead of B),
    and the response pass attends to them through the same padding mask: the same numbers up to float
    rounding."""
    firsts, expand = rows  # (D,), (B,)
    Q, T = query.shape[1], response.shape[1]
    mask = torch.cat([query_mask, response_mask], 1)  # (B, Q+T)
    position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, Q+T), as causal_forward
    name = cache_kwarg(lm)
    cache = recording_cache()
    prefix = lm(input_ids=query[firsts, :-1], attention_mask=query_mask[firsts, :-1],  # (D, Q-1) into the cache
                position_ids=position_ids[firsts, : Q - 1], use_cache=True, **{name: cache}, **logits_to_keep(lm, 1))
    ids = torch.cat([query[:, -1:], response[:, :-1]], 1)  # (B, T)
    out = lm(input_ids=ids, attention_mask=mask[:, :-1], position_ids=position_ids[:, Q - 1 : Q + T - 1],
             use_cache=True, output_hidden_states=hidden_states, **{name: expanded_cache(cache, expand)})
    logits = _ZeroGradTo.apply(out.logits, prefix.logits)  # (B, T, V); see _ZeroGradTo for why
    return logits, out.hidden_states[-1] if hidden_states else None


class _ZeroGradTo(torch.autograd.Function):
    """``x`` unchanged; in backward, ``other`` (the prefix pass's logits) also gets a gradient: zeros.

    Why: the prefix pass's keys and values reach the response pass through the cache, not through the
    blocks' outputs, and the prefix pass's last block feeds nothing the loss reads. A sharded block
    (FSDP2) gathers its weights for backward in a hook that fires when a gradient reaches the block's
    OUTPUT, and frees them after its backward of the response pass; the prefix pass's part of its
    backward would then run on freed weights (the last block's, always). The zero gradient reaches the
    prefix pass's output after the whole response pass's backward (autograd runs later-created nodes
    first) and before any prefix block's own backward, so each block's hook fires first there too. It
    adds exact zeros to the gradients; the forward is untouched."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        ctx.other = (other.shape, other.dtype, other.device)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        shape, dtype, device = ctx.other
        return grad, torch.zeros(shape, dtype=dtype, device=device) if ctx.needs_input_grad[1] else None


def logits_to_keep(lm: nn.Module, n: int) -> dict[str, int]:
    """``{"logits_to_keep": n}`` (only the last n positions' logits are computed) where ``lm`` accepts it."""
    base = lm.get_base_model() if hasattr(lm, "get_base_model") else lm  # a PEFT model passes kwargs through
    return {"logits_to_keep": n} if _takes_logits_to_keep(getattr(base.forward, "__func__", base.forward)) else {}


@functools.lru_cache(maxsize=None)
def _takes_logits_to_keep(forward: Callable[..., Any]) -> bool:
    """Whether a model's ``forward`` (the function, so the answer is per class) accepts ``logits_to_keep``.
    Cached: ``inspect.signature`` costs ~0.1 ms, a few % of a small model's scoring pass (benchmarks/README.md, floors)."""
    return "logits_to_keep" in inspect.signature(forward).parameters
