"""The two model protocols the loop talks to, and the value head every policy shares.

Shapes: ``B`` batch, ``Q`` (left-padded) query length, ``T`` (right-padded) response length, ``V`` vocab,
``H`` hidden size. Masks are True on real tokens.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from .. import ops
from ..seeding import stream_generator


class Policy(Protocol):
    """What the loop needs from a policy (an ``nn.Module``; its parameters are what PPO trains).

    Shapes: ``query`` (B, Q) left-padded, ``response`` (B, T) right-padded, masks True on real tokens.
    """

    def forward(self, query: torch.Tensor, query_mask: torch.Tensor, response: torch.Tensor,
                response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits (B, T, V) predicting each response token, and values (B, T): the value of the state in
        which response token t is chosen; None for a policy without a value head (critic-free
        estimators: no head module, parameters or optimizer state exist)."""
        ...

    def generate(self, query: torch.Tensor, query_mask: torch.Tensor, prompt_index: torch.Tensor | None = None,
                 **sampling: Any) -> torch.Tensor:
        """Sampled response token ids (B, T') for the queries (no query tokens; ends padded).
        ``prompt_index`` (B,): for each row, the first row holding the same query (``generation.prefill_once``:
        each distinct query is then prefilled once and its cache shared); None: every row on its own."""
        ...

    def generate_scored(self, query: torch.Tensor, query_mask: torch.Tensor, score_temperature: float,
                        prompt_index: torch.Tensor | None = None,
                        **sampling: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """As ``generate``, plus what ``forward`` would give for those tokens, taken from the decoding
        itself: log-probs (B, T') of the sampled tokens under the logits divided by ``score_temperature``
        (the sampling temperature, also when decoding greedily, as ``score_tokens``), and
        values (B, T'). Equal to ``forward``'s up to float rounding (KV-cached vs whole-sequence math)."""
        ...

    def save_pretrained(self, out: Path, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """Write the policy (without the value head) as a folder plain ``transformers`` can load; from
        ``state_dict`` (the policy's whole state dict) when given instead of from its parameters."""
        ...


class Reference(Protocol):
    """The frozen reference policy of the KL penalty."""

    # True when ``logprobs`` runs the policy's own weights (the ``shared`` trunk, the ``lora`` base), so
    # under fsdp the policy is gathered together with the reference for it (``rollout.score_tokens``).
    reads_policy: bool

    def logprobs(self, query: torch.Tensor, query_mask: torch.Tensor, response: torch.Tensor,
                 response_mask: torch.Tensor, temperature: float) -> torch.Tensor:
        """(B, T) log-probabilities of the response tokens under the reference, logits divided by
        ``temperature`` (the sampling policy's temperature, so the KL compares like with like)."""
        ...


def frozen_copy(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` in eval mode with no gradients: what every reference holds of the
    initial policy. Eval mode keeps dropout off (as the policy's passes); ``requires_grad_(False)``
    keeps the copy out of the optimizer, so it never moves."""
    return copy.deepcopy(module).eval().requires_grad_(False)


def transformer_blocks(module: nn.Module) -> list[nn.Module]:
    """The transformer blocks of the Hugging Face models inside ``module`` (the classes their models
    declare in ``_no_split_modules``), in module order."""
    names = {n for m in module.modules() for n in (getattr(m, "_no_split_modules", None) or [])}
    return [m for m in module.modules() if type(m).__name__ in names]


def checkpoint_activations(lm: nn.Module) -> int:
    """Activation checkpointing of every transformer block of ``lm``; returns how many were wrapped.

    Why not transformers' ``gradient_checkpointing_enable``: it only acts in train mode, and rallyrl runs
    the policy in eval mode (dropout off, so rollout and update log-probs agree). Each block's forward
    is wrapped in ``torch.utils.checkpoint`` (non-reentrant, RNG state preserved) whenever gradients
    are on, so only the block inputs are kept and the rest is recomputed in backward: the same values,
    so the same gradients. Without gradients (generation, scoring, the reference) the block runs as
    before. Apply it after any copy of ``lm`` is made (a deep copy would keep calling these wrappers).
    Under FSDP2 each wrapped block is then sharded as a unit, so its recomputation runs on the gathered
    weights (``fully_shard`` unshards a unit before its backward)."""
    from torch.utils.checkpoint import checkpoint

    blocks = transformer_blocks(lm)
    for block in blocks:
        def forward(*args: Any, _run: Any = block.forward, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return _run(*args, **kwargs)
            return checkpoint(_run, *args, use_reentrant=False, **kwargs)

        block.forward = forward
    return len(blocks)


def make_value_head(hidden: int, kind: str, std: float, seed: int, dtype: torch.dtype) -> nn.Module:
    """Scalar value head on a hidden state, initialised from the shared seed: identical on every rank
    and independent of the global RNG. ``linear`` as TRL; ``mlp`` is trlx's Linear(H, 2H) -> ReLU ->
    Linear(2H, 1), more capacity for the value than a single projection of the policy's features."""
    g = stream_generator(seed, "value_head")
    last: nn.Linear
    if kind == "mlp":
        first = nn.Linear(hidden, 2 * hidden, dtype=dtype)
        with torch.no_grad():
            bound = 1.0 / hidden**0.5  # nn.Linear's default init, drawn from the shared generator
            first.weight.copy_((torch.rand(first.weight.shape, generator=g) * 2 - 1) * bound)
            first.bias.copy_((torch.rand(first.bias.shape, generator=g) * 2 - 1) * bound)
        last = nn.Linear(2 * hidden, 1, dtype=dtype)
        head: nn.Module = nn.Sequential(first, nn.ReLU(), last)
    else:
        last = nn.Linear(hidden, 1, dtype=dtype)
        head = last
    with torch.no_grad():
        last.weight.copy_((torch.randn(last.weight.shape, generator=g) * std).to(dtype))
        last.bias.zero_()
    return head


def lm_save_kwargs(state_dict: dict[str, torch.Tensor] | None) -> dict[str, Any]:
    """``save_pretrained`` kwargs writing the ``lm.*`` part of a policy state dict (none: its own weights)."""
    if state_dict is None:
        return {}
    return {"state_dict": {k[len("lm."):]: v for k, v in state_dict.items() if k.startswith("lm.")}}


def value_head_or_none(hidden: int, kind: str | None, std: float, seed: int, dtype: torch.dtype) -> nn.Module | None:
    """``make_value_head``, or None when the estimator needs no critic (``kind`` None)."""
    return None if kind is None else make_value_head(hidden, kind, std, seed, dtype)


@contextlib.contextmanager
def last_position_states(module: nn.Module | None, of_input: bool) -> Iterator[list[torch.Tensor]]:
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


def distinct_rows(prompt_index: torch.Tensor | None, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """From ``prompt_index`` (B,) (each row's first row with the same query): the distinct rows to
    prefill (D,), ascending, and for each row its position among them (B,), to expand a (D, ...) result
    to (B, ...) with one index; None when there is nothing to share (no index, or no row repeats)."""
    if prompt_index is None:
        return None
    firsts, expand = torch.unique(prompt_index.to(device), return_inverse=True)
    return (firsts, expand) if len(firsts) < len(prompt_index) else None


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
        # ranks call generate() different numbers of times; rallyrl gathers the weights for the whole
        # call instead (dist.gathered), so decoding needs no collective at all.
        return lm.generate(input_ids=query, attention_mask=query_mask, use_cache=True, synced_gpus=False, **kwargs)
    finally:
        hf_log.removeFilter(_errors_only)


def _errors_only(record: logging.LogRecord) -> bool:
    """A logging filter that lets through errors and worse only (what ``setLevel(ERROR)`` would)."""
    return record.levelno >= logging.ERROR
