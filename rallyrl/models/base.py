"""The two model protocols the loop talks to, and the value head every policy shares.

Shapes: ``B`` batch, ``Q`` (left-padded) query length, ``T`` (right-padded) response length, ``V`` vocab,
``H`` hidden size. Masks are True on real tokens.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch
from torch import nn

from ..seeding import stream_generator

T = TypeVar("T")


class Policy(Protocol):
    """What the loop needs from a policy (an ``nn.Module``; its parameters are what PPO trains).

    Shapes: ``query`` (B, Q) left-padded, ``response`` (B, T) right-padded, masks True on real tokens.
    """

    lm: nn.Module  # the transformers model: what a generation engine samples with (rollout/hf.py)
    v_head: nn.Module | None  # the value head on the final hidden state; None without a critic

    def forward(self, query: torch.Tensor, query_mask: torch.Tensor, response: torch.Tensor,
                response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits (B, T, V) predicting each response token, and values (B, T): the value of the state in
        which response token t is chosen; None for a policy without a value head (critic-free
        estimators: no head module, parameters or optimizer state exist)."""
        ...

    def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(self, *args, **kwargs)``, entered as a forward of this module: the generation engine
        decodes through it, so what applies to ``forward`` applies to decoding too (FSDP's root hooks
        when sharded, bf16 autocast under ``train.mixed_precision``: both are set up for ``forward``
        and ``run`` by ``dist.shard``)."""
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


def run_as_forward(self: nn.Module, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``Policy.run`` of every policy class: ``fn(self, ...)``. A method of its own (not a call of ``fn``
    from outside) so that ``dist.shard`` can register it like ``forward`` (see ``Policy.run``)."""
    return fn(self, *args, **kwargs)


def value_head_or_none(hidden: int, kind: str | None, std: float, seed: int, dtype: torch.dtype) -> nn.Module | None:
    """``make_value_head``, or None when the estimator needs no critic (``kind`` None)."""
    return None if kind is None else make_value_head(hidden, kind, std, seed, dtype)
