"""The two model protocols the loop talks to, and the value head every policy shares.

Shapes: ``B`` batch, ``Q`` (left-padded) query length, ``T`` (right-padded) response length, ``V`` vocab,
``H`` hidden size. Masks are True on real tokens.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from ..seeding import stream_generator


class Policy(Protocol):
    """What the loop needs from a policy (an ``nn.Module``; its parameters are what PPO trains).

    Shapes: ``query`` (B, Q) left-padded, ``response`` (B, T) right-padded, masks True on real tokens.
    """

    def forward(self, query: torch.Tensor, query_mask: torch.Tensor, response: torch.Tensor,
                response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits (B, T, V) predicting each response token, and values (B, T): the value of the state in
        which response token t is chosen."""
        ...

    def generate(self, query: torch.Tensor, query_mask: torch.Tensor, **sampling: Any) -> torch.Tensor:
        """Sampled response token ids (B, T') for the queries (no query tokens; ends padded)."""
        ...

    def save_pretrained(self, out: Path, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """Write the policy (without the value head) as a folder plain ``transformers`` can load; from
        ``state_dict`` (the policy's whole state dict) when given instead of from its parameters."""
        ...


class Reference(Protocol):
    """The frozen reference policy of the KL penalty."""

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
