"""The Hugging Face engine: ``transformers``' ``generate`` on the policy's own weights, one class for causal
and seq2seq models.

It samples with the very module PPO trains (no copy, nothing to push: ``sync`` only counts), so its
log-probs are those of the training forward up to the float rounding of KV-cached decoding. What differs
between a causal and a seq2seq model here is small and lives in a ``_Layout``: how a group's shared prompt
is computed once (the prompt's KV cache / the encoder's output, ``prefill.py``), where the response starts
in ``generate``'s output, and which module's output is the hidden state the value head reads.

Every decode runs through ``policy.run`` (``models.base.run_as_forward``), which is the policy's forward
entry for generation: under FSDP its root hooks, under bf16 its autocast apply exactly as to ``forward``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .. import dist, ops
from .padding import pad
from .engine import Sampled, SamplingSpec, no_prompts
from .prefill import prompt_index, shared_encoding, shared_prefill


@dataclass(frozen=True)
class _Layout:
    """What a model family changes about generation (see the module docstring)."""

    prefill: Callable[..., dict[str, Any]]  # (lm, query, query_mask, prompt_index) -> generate() kwargs
    response: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (generate()'s sequences, query) -> (B, T')
    # The module whose hidden state at each step is forward()'s value-head input, and whether it is that
    # module's input (the LM head of a causal LM: its input is hidden_states[-1]) or output (T5's decoder
    # stack: not the LM head's input, which a tied T5 rescales).
    value_states: Callable[[nn.Module], tuple[nn.Module, bool]]


_CAUSAL = _Layout(shared_prefill, lambda seq, query: seq[:, query.shape[1]:],  # a causal LM echoes the query
                  lambda lm: (lm.get_output_embeddings(), True))
_SEQ2SEQ = _Layout(shared_encoding, lambda seq, query: seq[:, 1:],  # decoder output starts with its start token
                   lambda lm: (lm.get_decoder(), False))


class HFEngine:
    """``GenerationEngine`` over ``policy.lm.generate`` (KV cache on). With ``prefill_once`` a prompt that
    repeats in a call (a group's G members) is prefilled once and its cache shared by its copies."""

    def __init__(self, policy: nn.Module, tokenizer: Any, device: torch.device, prefill_once: bool = True,
                 version: int = 0) -> None:
        self.policy, self.tokenizer, self.device, self.prefill_once = policy, tokenizer, device, prefill_once
        self.layout = _SEQ2SEQ if getattr(policy.lm.config, "is_encoder_decoder", False) else _CAUSAL
        self.version = version

    def ready(self) -> contextlib.AbstractContextManager[None]:
        # FSDP: the policy's weights are gathered once for every decode of the round (a collective), after
        # which ranks decode independently for as many steps and turns as their own samples need.
        return dist.gathered(self.policy)

    def sync(self, policy: Any) -> None:
        self.version += 1  # the engine samples with the trained module itself: nothing to copy

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], spec: SamplingSpec) -> Sampled:
        if not prompts:
            return no_prompts(self.version, spec)
        tok = self.tokenizer
        q, qm = pad(prompts, tok.pad_token_id, left=True)  # (B, Q)
        same = prompt_index(prompts) if self.prefill_once else None  # a group's G copies: one prefill
        index = torch.tensor(same, device=self.device) if same is not None else None
        ids, logprobs, values = self.policy.run(_decode, q.to(self.device), qm.to(self.device), index, self.layout,
                                                spec.temperature if spec.logprobs else None, _sampling_kwargs(spec, tok))
        kept = [truncate(r, spec, tok) for r in ids.tolist()]
        return Sampled(kept, logprobs, values, self.version)


def _sampling_kwargs(spec: SamplingSpec, tokenizer: Any) -> dict[str, Any]:
    """``generate()`` kwargs of a spec."""
    stop = list(spec.stop_token_ids)
    kw: dict[str, Any] = dict(max_new_tokens=spec.max_new_tokens, do_sample=spec.do_sample,
                              pad_token_id=tokenizer.pad_token_id, eos_token_id=stop[0] if len(stop) == 1 else stop or None)
    if spec.do_sample:
        kw.update(temperature=spec.temperature, top_k=spec.top_k or None, top_p=spec.top_p)
    else:  # greedy: unset, so a model's generation_config cannot turn sampling knobs on
        kw.update(temperature=None, top_k=None, top_p=None)
    return kw


def _decode(policy: nn.Module, query: torch.Tensor, query_mask: torch.Tensor, prompt_index: torch.Tensor | None,
            layout: _Layout, score_temperature: float | None,
            sampling: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Run by ``policy.run``: the response ids (B, T') and, with ``score_temperature``, what ``forward``
    would give for them taken from the decoding itself: log-probs of the sampled tokens under the logits
    divided by it (the sampling temperature, also when decoding greedily) and values (None without a
    value head). Equal to ``forward``'s up to float rounding (KV-cached vs whole-sequence math)."""
    lm, v_head = policy.lm, policy.v_head
    prefix = layout.prefill(lm, query, query_mask, prompt_index)  # before the hook: it chooses no token
    if score_temperature is None:
        return layout.response(quiet_generate(lm, query, query_mask, **prefix, **sampling), query), None, None
    module, of_input = layout.value_states(lm) if v_head is not None else (None, True)
    with last_position_states(module, of_input) as states:
        out = quiet_generate(lm, query, query_mask, return_dict_in_generate=True, output_logits=True,
                             **prefix, **sampling)
    ids = layout.response(out.sequences, query)  # (B, T')
    return ids, *scored_from_generation(ids, out.logits, states, v_head, score_temperature)


def truncate(ids: list[int], spec: SamplingSpec, tokenizer: Any) -> list[int]:
    """A sampled sequence as trained on: cut after its first stop token (kept: choosing to stop is an
    action with a reward; what follows is generate()'s padding), then after a stop sequence. Never
    empty (generate() samples at least one token, and both cuts keep at least one)."""
    stops = set(spec.stop_token_ids)
    for i, t in enumerate(ids):
        if t in stops:
            ids = ids[: i + 1]
            break
    ids = truncate_at_stop(ids, tokenizer, list(spec.stop_sequences))
    return ids or [spec.stop_token_ids[0] if spec.stop_token_ids else tokenizer.pad_token_id]


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


def quiet_generate(lm: nn.Module, query: torch.Tensor, query_mask: torch.Tensor, **kwargs: Any) -> Any:
    """``lm.generate`` with the KV cache and without lock-step decoding (the whole output: a causal LM
    echoes the query first, a seq2seq LM starts with the decoder-start token)."""
    # We always pass the attention mask, but generate() drops an all-ones one, after which the pads of
    # finished rows make transformers warn about a missing mask; that warning does not apply.
    # A filter, not setLevel: Logger.setLevel clears the level cache of every logger in the process
    # (hundreds, with transformers loaded) on each call, milliseconds per generate() (benchmarks/README.md, floors).
    hf_log = logging.getLogger("transformers.modeling_utils")
    hf_log.addFilter(_errors_only)
    try:
        # synced_gpus=False: ranks never decode in lock-step. transformers turns synced_gpus on for a
        # model with FSDP-sharded blocks (a per-step all-reduce of "done" flags), which would hang when
        # ranks call generate() different numbers of times; the engine gathers the weights for the whole
        # round instead (HFEngine.ready), so decoding needs no collective at all.
        return lm.generate(input_ids=query, attention_mask=query_mask, use_cache=True, synced_gpus=False, **kwargs)
    finally:
        hf_log.removeFilter(_errors_only)


def _errors_only(record: logging.LogRecord) -> bool:
    """A logging filter that lets through errors and worse only (what ``setLevel(ERROR)`` would)."""
    return record.levelno >= logging.ERROR


@contextlib.contextmanager
def last_position_states(module: nn.Module | None, of_input: bool) -> Any:
    """Collect, for every forward call of ``module`` while open, the hidden state (B, H) at its last
    sequence position: of its first input (``of_input``, e.g. the LM head, whose input is the final
    hidden state) or of its output's ``last_hidden_state`` (e.g. a decoder stack). During generation
    one call is one decoding step, so the list holds the state each sampled token was chosen in."""
    states: list[torch.Tensor] = []
    if module is None:  # nothing to collect (a policy without a value head)
        yield states
        return

    def pre(_m: nn.Module, args: tuple) -> None:
        states.append(args[0][:, -1].detach().clone())  # clone: a view would keep the whole prefill alive

    def post(_m: nn.Module, _args: tuple, out: Any) -> None:
        h = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        states.append(h[:, -1].detach().clone())

    handle = module.register_forward_pre_hook(pre) if of_input else module.register_forward_hook(post)
    try:
        yield states
    finally:
        handle.remove()


def scored_from_generation(ids: torch.Tensor, step_logits: tuple[torch.Tensor, ...], states: list[torch.Tensor],
                           v_head: nn.Module | None, temperature: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (B, T') and values (B, T') of generated ``ids`` (B, T') from generate()'s raw per-step
    logits (``output_logits``: T' tensors (B, V)) and the per-step hidden states of
    ``last_position_states``. Step t's logits and state are those response token t was sampled from."""
    T = ids.shape[1]
    if len(step_logits) != T or (v_head is not None and len(states) != T):
        raise RuntimeError(f"generate() ran {len(states)} forward steps and returned {len(step_logits)} logits "
                           f"for {T} new tokens; rollout.logprobs_from=generate needs one of each per token")
    # one step at a time: a (B, T', V) stack would double the logits' memory
    logprobs = torch.stack([ops.logprobs_from_logits(lg.float() / temperature, ids[:, t])
                            for t, lg in enumerate(step_logits)], 1)  # (B, T')
    if v_head is None:
        return logprobs, None
    values = v_head(torch.stack(states, 1)).squeeze(-1).float()  # (B, T')
    return logprobs, values
