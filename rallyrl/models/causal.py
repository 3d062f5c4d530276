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
from .base import frozen_copy, lm_save_kwargs, run_as_forward, value_head_or_none


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

    run = run_as_forward  # the generation engine's entry (models/base.py)

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


def logits_to_keep(lm: nn.Module, n: int) -> dict[str, int]:
    """``{"logits_to_keep": n}`` (only the last n positions' logits are computed) where ``lm`` accepts it."""
    base = lm.get_base_model() if hasattr(lm, "get_base_model") else lm  # a PEFT model passes kwargs through
    return {"logits_to_keep": n} if _takes_logits_to_keep(getattr(base.forward, "__func__", base.forward)) else {}


@functools.lru_cache(maxsize=None)
def _takes_logits_to_keep(forward: Callable[..., Any]) -> bool:
    """Whether a model's ``forward`` (the function, so the answer is per class) accepts ``logits_to_keep``.
    Cached: ``inspect.signature`` costs ~0.1 ms, a few % of a small model's scoring pass (benchmarks/README.md, floors)."""
    return "logits_to_keep" in inspect.signature(forward).parameters
