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
from .base import (distinct_rows, frozen_copy, last_position_states, lm_save_kwargs, quiet_generate,
                   scored_from_generation, value_head_or_none)


class Seq2SeqPolicy(nn.Module):
    """A seq2seq LM plus a scalar value head on the decoder's last hidden state (``head`` None: none,
    as ``CausalPolicy``)."""

    def __init__(self, lm: nn.Module, value_head_std: float, seed: int, head: str | None = "linear") -> None:
        super().__init__()
        self.lm = lm
        hidden = getattr(lm.config, "d_model", None) or lm.config.get_text_config().hidden_size
        self.v_head = value_head_or_none(hidden, head, value_head_std, seed, next(lm.parameters()).dtype)

    def forward(self, query: torch.Tensor, query_mask: torch.Tensor, response: torch.Tensor,
                response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = _seq2seq_forward(self.lm, query, query_mask, response, response_mask,
                               hidden_states=self.v_head is not None)
        if self.v_head is None:
            return out.logits, None
        hidden = out.decoder_hidden_states[-1]  # (B, T, H): the state in which response token t is chosen
        return out.logits, self.v_head(hidden).squeeze(-1)  # (B, T, V), (B, T)

    @torch.no_grad()
    def generate(self, query: torch.Tensor, query_mask: torch.Tensor, prompt_index: torch.Tensor | None = None,
                 **sampling: Any) -> torch.Tensor:
        enc = shared_encoding(self.lm, query, query_mask, prompt_index)
        # generate returns decoder ids, starting with the decoder-start token
        return quiet_generate(self.lm, query, query_mask, **enc, **sampling)[:, 1:]  # (B, T')

    @torch.no_grad()
    def generate_scored(self, query: torch.Tensor, query_mask: torch.Tensor, score_temperature: float,
                        prompt_index: torch.Tensor | None = None,
                        **sampling: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        enc = shared_encoding(self.lm, query, query_mask, prompt_index)
        # The decoder stack's output is forward()'s decoder_hidden_states[-1] (not the LM head's input:
        # a tied T5 rescales it before the head).
        decoder = self.lm.get_decoder() if self.v_head is not None else None
        with last_position_states(decoder, of_input=False) as states:
            out = quiet_generate(self.lm, query, query_mask, return_dict_in_generate=True, output_logits=True,
                                 **enc, **sampling)
        ids = out.sequences[:, 1:]  # (B, T')
        return ids, *scored_from_generation(ids, out.logits, states, self.v_head, score_temperature)

    def save_pretrained(self, out: Path, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        self.lm.save_pretrained(out, safe_serialization=True, **lm_save_kwargs(state_dict))  # as CausalPolicy


class Seq2SeqCopyReference(nn.Module):
    """The reference as a full frozen copy of the initial seq2seq LM."""

    reads_policy = False  # its own weights only: under fsdp it is gathered alone

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = frozen_copy(lm)

    @torch.no_grad()
    def logprobs(self, query: torch.Tensor, query_mask: torch.Tensor, response: torch.Tensor,
                 response_mask: torch.Tensor, temperature: float) -> torch.Tensor:
        logits = _seq2seq_forward(self.lm, query, query_mask, response, response_mask, hidden_states=False).logits
        return ops.logprobs_from_logits(logits.float() / temperature, response)  # (B, T)


def shared_encoding(lm: nn.Module, query: torch.Tensor, query_mask: torch.Tensor,
                    prompt_index: torch.Tensor | None) -> dict[str, Any]:
    """``generate`` kwargs that encode each distinct query once (``generation.prefill_once``): the
    encoder's output on the D distinct rows, expanded to the B rows by index (generate() skips its own
    encoder pass when given ``encoder_outputs``); {} for the ordinary path (no repeated query). A row's
    encoding depends on that row alone, so every row gets what its own encoding would be (up to float
    rounding of a smaller batch); the attention mask of all B rows still goes to generate()."""
    rows = distinct_rows(prompt_index, query.device)
    if rows is None:
        return {}
    firsts, expand = rows
    enc = lm.get_encoder()(input_ids=query[firsts], attention_mask=query_mask[firsts], return_dict=True)
    enc["last_hidden_state"] = enc.last_hidden_state[expand]  # (D, Q, H) -> (B, Q, H)
    return {"encoder_outputs": enc}


def decoder_start_id(lm: nn.Module) -> int:
    """The decoder-start token (T5: the pad token), from the model's generation or model config."""
    for c in (getattr(lm, "generation_config", None), lm.config):
        v = getattr(c, "decoder_start_token_id", None) if c is not None else None
        if v is not None:
            return int(v)
    raise ValueError("the seq2seq model sets no decoder_start_token_id (config.json or generation_config.json)")


def _seq2seq_forward(lm: nn.Module, query: torch.Tensor, query_mask: torch.Tensor, response: torch.Tensor,
                     response_mask: torch.Tensor, hidden_states: bool) -> Any:
    """Encode the query, decode ``[start | response[:-1]]`` (teacher forcing) with the response mask
    shifted the same way (the start token is always real). Right padding of the response is causal-safe:
    pads come after every real token, and their outputs are masked by the loop."""
    B = response.shape[0]
    start = torch.full((B, 1), decoder_start_id(lm), dtype=response.dtype, device=response.device)
    dec_ids = torch.cat([start, response[:, :-1]], 1)  # (B, T)
    dec_mask = torch.cat([torch.ones_like(response_mask[:, :1]), response_mask[:, :-1]], 1)  # (B, T)
    return lm(input_ids=query, attention_mask=query_mask, decoder_input_ids=dec_ids,
              decoder_attention_mask=dec_mask, output_hidden_states=hidden_states, use_cache=False)
