"""Encoder-decoder LMs (``AutoModelForSeq2SeqLM``, e.g. T5): the policy with a value head and the
full-copy reference.

The encoder reads the left-padded query (T5's relative attention ignores absolute positions and the
attention mask hides the pads, so left padding is exact; tests/smoke/test_seq2seq.py checks it). The
decoder is teacher-forced on ``decoder_start_token + response[:-1]``, so decoder position t predicts
response token t; no query tokens are ever concatenated with the response.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import ops
from .base import frozen_copy, lm_save_kwargs, run_as_forward, value_head_or_none
from .prefix import distinct_queries


class Seq2SeqPolicy(nn.Module):
    """A seq2seq LM plus a scalar value head on the decoder's last hidden state (``head`` None: none,
    as ``CausalPolicy``)."""

    def __init__(self, lm: nn.Module, value_head_std: float, seed: int, head: str | None = "linear",
                 prefill_once: bool = True) -> None:
        super().__init__()
        self.lm = lm
        self.prefill_once = prefill_once  # model.prefill_once: a query repeated in a batch is encoded once
        hidden = getattr(lm.config, "d_model", None) or lm.config.get_text_config().hidden_size
        self.v_head = value_head_or_none(hidden, head, value_head_std, seed, next(lm.parameters()).dtype)

    run = run_as_forward  # the generation engine's entry (models/base.py)

    def forward(self, query: torch.Tensor, query_mask: torch.Tensor, response: torch.Tensor,
                response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = _seq2seq_forward(self.lm, query, query_mask, response, response_mask,
                               hidden_states=self.v_head is not None, prefill_once=self.prefill_once)
        if self.v_head is None:
            return out.logits, None
        hidden = out.decoder_hidden_states[-1]  # (B, T, H): the state in which response token t is chosen
        return out.logits, self.v_head(hidden).squeeze(-1)  # (B, T, V), (B, T)

    def save_pretrained(self, out: Path, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        self.lm.save_pretrained(out, safe_serialization=True, **lm_save_kwargs(state_dict))  # as CausalPolicy


class Seq2SeqCopyReference(nn.Module):
    """The reference as a full frozen copy of the initial seq2seq LM."""

    reads_policy = False  # its own weights only: under fsdp it is gathered alone

    def __init__(self, lm: nn.Module, prefill_once: bool = True) -> None:
        super().__init__()
        self.lm = frozen_copy(lm)
        self.prefill_once = prefill_once  # as Seq2SeqPolicy

    @torch.no_grad()
    def logprobs(self, query: torch.Tensor, query_mask: torch.Tensor, response: torch.Tensor,
                 response_mask: torch.Tensor, temperature: float) -> torch.Tensor:
        logits = _seq2seq_forward(self.lm, query, query_mask, response, response_mask, hidden_states=False,
                                  prefill_once=self.prefill_once).logits
        return ops.logprobs_from_logits(logits.float() / temperature, response)  # (B, T)


def decoder_start_id(lm: nn.Module) -> int:
    """The decoder-start token (T5: the pad token), from the model's generation or model config."""
    for c in (getattr(lm, "generation_config", None), lm.config):
        v = getattr(c, "decoder_start_token_id", None) if c is not None else None
        if v is not None:
            return int(v)
    raise ValueError("the seq2seq model sets no decoder_start_token_id (config.json or generation_config.json)")


def _seq2seq_forward(lm: nn.Module, query: torch.Tensor, query_mask: torch.Tensor, response: torch.Tensor,
                     response_mask: torch.Tensor, hidden_states: bool, prefill_once: bool = False) -> Any:
    """Encode the query, decode ``[start | response[:-1]]`` (teacher forcing) with the response mask
    shifted the same way (the start token is always real). Right padding of the response is causal-safe:
    pads come after every real token, and their outputs are masked by the loop. With ``prefill_once`` and
    a query that repeats in the batch, the encoder runs once per distinct query and its output is
    expanded to the copies by index (a row's encoding depends on that row alone, so each row gets what
    its own encoding would be, up to float rounding; the index carries every copy's gradient back)."""
    B = response.shape[0]
    start = torch.full((B, 1), decoder_start_id(lm), dtype=response.dtype, device=response.device)
    dec_ids = torch.cat([start, response[:, :-1]], 1)  # (B, T)
    dec_mask = torch.cat([torch.ones_like(response_mask[:, :1]), response_mask[:, :-1]], 1)  # (B, T)
    rows = distinct_queries(query, query_mask) if prefill_once else None
    encoder: dict[str, Any] = {"input_ids": query}
    if rows is not None:
        firsts, expand = rows  # (D,), (B,)
        enc = lm.get_encoder()(input_ids=query[firsts], attention_mask=query_mask[firsts], return_dict=True)
        enc["last_hidden_state"] = enc.last_hidden_state[expand]  # (D, Q, H) -> (B, Q, H)
        encoder = {"encoder_outputs": enc}
    return lm(attention_mask=query_mask, decoder_input_ids=dec_ids, decoder_attention_mask=dec_mask,
              output_hidden_states=hidden_states, use_cache=False, **encoder)
