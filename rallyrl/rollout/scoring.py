"""The rollout-time forward passes over one chunk's episodes: the policy's log-probs and values, the
reference's log-probs (``rollout.logprobs_from: forward``; with ``generate`` the policy's part was kept by
the engine while it sampled and only the reference runs here)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import dist, ops
from ..models import Policy, Reference
from .episode import Episodes


@dataclass
class Scored:
    """The rollout-time forward passes over one chunk (response positions; 0 off the action mask)."""

    logprobs: torch.Tensor  # (B, T) of the sampling policy (temperature applied)
    ref_logprobs: torch.Tensor | None  # (B, T) of the frozen reference; None: no reference (beta 0)
    values: torch.Tensor | None  # (B, T); None: the policy has no value head (critic-free)


@torch.no_grad()
def score_tokens(policy: Policy, reference: Reference | None, ep: Episodes, temperature: float,
                 device: torch.device, from_generation: bool = False) -> Scored | None:
    """One forward of the policy (log-probs + values, if it has a value head) and one of the reference
    (log-probs; skipped when there is none); None for an empty chunk. With ``from_generation``
    (``rollout.logprobs_from: generate``) the policy's part was kept by the engine and only the reference
    runs. Every rank calls it in every chunk round: under
    FSDP each model is gathered in turn (one whole model at a time) around its forward, so a rank
    without samples still takes part (``from_generation`` comes from the config, the same on all ranks).
    A reference that runs the policy's own weights (``reads_policy``: the ``shared`` trunk, the ``lora``
    base) is gathered together with the policy instead, for both passes: its forward reads them."""
    q, qm = ep.query_ids.to(device), ep.query_mask.to(device)
    r, rm = ep.response_ids.to(device), ep.response_mask.to(device)
    am = ep.action_mask.to(device)
    if from_generation and ep.logprobs is None:
        raise ValueError("score_tokens(from_generation=True) needs episodes sampled with SamplingSpec(logprobs=True)")
    logprobs = values = ref_lp = None

    def policy_pass() -> None:
        nonlocal logprobs, values
        if len(ep) and not from_generation:
            logits, values = policy(q, qm, r, rm)  # (B, T, V), (B, T)
            # Temperature is part of the sampling policy, so log-probs (and the KL) are of the scaled
            # logits, in the rollout pass and in training alike (as in TRL).
            logprobs = ops.logprobs_from_logits(logits.float() / temperature, r)  # (B, T)

    def reference_pass() -> None:
        nonlocal ref_lp
        if len(ep):
            ref_lp = reference.logprobs(q, qm, r, rm, temperature)  # (B, T)

    # Every choice below comes from the config (the same on every rank): no rank skips a collective.
    if reference is not None and reference.reads_policy:
        with dist.gathered(policy, reference):
            policy_pass()
            reference_pass()
    else:
        if not from_generation:
            with dist.gathered(policy):
                policy_pass()
        if reference is not None:
            with dist.gathered(reference):
                reference_pass()
    if not len(ep):
        return None
    ref = (ref_lp * am).cpu() if ref_lp is not None else None
    if from_generation:  # the engine's, already masked and on the CPU
        return Scored(logprobs=ep.logprobs, ref_logprobs=ref, values=ep.values)
    return Scored(logprobs=(logprobs * am).cpu(), ref_logprobs=ref,
                  values=(values.float() * am).cpu() if values is not None else None)
