"""Stage 5 of the loop: the PPO epochs (minibatches, micro-batches, one optimizer step per minibatch).

The loss is aggregated over the GLOBAL minibatch (``ops.aggregate_loss`` with a normaliser counted over
every rank), so one process and N processes compute the same gradient on the same samples. The forward
sees the attention mask; the loss, KL and value targets are over ``Advantages.loss_mask`` (the action
mask, minus the groups ``ppo.drop_zero_std_groups`` leaves out).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

from .. import dist, ops
from ..config import PPOConfig
from ..rollout import Advantages, Rollouts
from .state import Learner, TrainState


# Per-micro-batch statistics, summed in one device tensor (no host sync per micro-batch).
UPDATE_STATS = ("pg_loss", "vf_loss", "kl_loss", "loss", "clipfrac_tok", "vf_clipfrac_tok", "approx_kl_tok",
                "entropy_tok", "tokens", "action_tokens")


@dataclass(frozen=True)
class _Batch:
    """The update's view of an iteration (CPU tensors; rows are this rank's samples)."""

    ro: Rollouts
    adv: Advantages
    resp_len: list[int]  # per row, on the host: micro-batches trim all-padding columns with plain ints
    query_len: list[int]
    beta: float  # the KL coefficient in the loss (`ppo.kl_in: loss`), else 0
    max_len: int  # generation.max_new_tokens (`seq_mean_token_sum`)


@dist.stage("PPO update")
def ppo_update(learner: Learner, ro: Rollouts, adv: Advantages, state: TrainState, ppo: PPOConfig,
               temperature: float, max_new_tokens: int, device: torch.device) -> dict[str, float]:
    """``ppo.epochs`` passes over the batch in ``ppo.num_minibatches`` optimizer steps. Returns the sums
    of ``UPDATE_STATS`` plus ``grad_norm`` (summed over applied steps), ``steps``, ``skipped`` and
    ``time`` (this rank's wall seconds; not reduced)."""
    t_start, B, M, W = time.perf_counter(), len(ro), ppo.num_minibatches, dist.world_size()
    beta = state.kl_ctl.value if ppo.kl_in == "loss" and ro.ref_logprobs is not None else 0.0
    # Per row, on the host in one read: response and query lengths, and what the loss normaliser counts
    # (tokens in the loss, or 1 per sequence still in it).
    units = adv.loss_mask.sum(1) if ppo.loss_aggregation == "token_mean" else adv.loss_mask.any(1)
    resp_len, query_len, row_units = torch.stack([ro.response_mask.sum(1), ro.query_mask.sum(1), units.long()]).tolist()
    batch = _Batch(ro, adv, resp_len, query_len, beta, max_new_tokens)
    sums = torch.zeros(len(UPDATE_STATS), dtype=torch.float64, device=device)
    norm_sum, steps, skipped = 0.0, 0, 0
    for _ in range(ppo.epochs):
        perm = torch.randperm(B, generator=state.shuffle_gen)
        minibatches = [mb.tolist() for mb in torch.tensor_split(perm, M)]
        # The loss is aggregated over the GLOBAL minibatch: one all-reduce of all M normalisers (token or
        # sequence counts) per epoch. DDP averages gradients over W ranks, so each rank divides by N/W.
        local_counts = torch.tensor([float(sum(row_units[i] for i in mb)) for mb in minibatches], dtype=torch.float64)
        global_counts = dist.all_reduce_sum(local_counts)
        for j, mb in enumerate(minibatches):
            learner.optimizer.zero_grad(set_to_none=True)
            # Gradient accumulation over micro-batches: every piece is normalised by the same global
            # count, so the summed gradient equals the whole minibatch's. Only the last backward
            # synchronises (ranks may take different numbers of micro-batches).
            micro = [mb[a : a + (ppo.micro_batch_size or len(mb))] for a in range(0, len(mb), ppo.micro_batch_size or len(mb))]
            step_loss = torch.zeros((), dtype=torch.float64, device=device)
            for k, rows in enumerate(micro):
                sync = contextlib.nullcontext() if k == len(micro) - 1 else dist.no_sync(learner.model)
                with sync:
                    part = _micro_step(learner.model, batch, rows, global_counts[j].clamp(min=1) / W, ppo,
                                       temperature, device)
                sums += part
                step_loss += part[UPDATE_STATS.index("loss")]
            norm = learner.step(step_loss)  # one reduction + one host sync; None if not applied
            if norm is None:
                skipped += 1
                state.nonfinite_skips += 1
            else:
                norm_sum += norm
                steps += 1
                state.optimizer_steps += 1
    out = dict(zip(UPDATE_STATS, sums.tolist()))
    out.update(grad_norm=norm_sum, steps=float(steps), skipped=float(skipped), time=time.perf_counter() - t_start)
    return out


def _micro_step(model: torch.nn.Module, batch: _Batch, rows: list[int], n_norm: torch.Tensor, ppo: PPOConfig,
                temperature: float, device: torch.device) -> torch.Tensor:
    """Forward + backward of the loss on ``rows``; returns its ``UPDATE_STATS`` as a device tensor."""
    ro, adv = batch.ro, batch.adv
    # Trim columns that are padding for every row of this micro-batch (pure speed; same math).
    T, Q = max(batch.resp_len[i] for i in rows), ro.query_ids.shape[1]
    q0 = Q - max(batch.query_len[i] for i in rows)
    idx = torch.tensor(rows)

    def take(x: torch.Tensor, cols: slice) -> torch.Tensor:
        return x[idx, cols].to(device)

    t = slice(0, T)
    resp, m = take(ro.response_ids, t), take(ro.response_mask, t)  # (b, T)
    lm = take(adv.loss_mask, t)  # (b, T) the tokens in the loss
    am = take(ro.action_mask, t)  # (b, T) every sampled token: the entropy is the policy's on all of them
    agg = dict(aggregation=ppo.loss_aggregation, max_len=batch.max_len)
    logits, values = model(take(ro.query_ids, slice(q0, Q)), take(ro.query_mask, slice(q0, Q)), resp, m)
    logits = logits.float() / temperature  # (b, T, V)
    lp = ops.logprobs_from_logits(logits, resp)  # (b, T)
    pg, pg_stats = _policy_loss(ppo, lp, take(ro.logprobs, t), take(adv.advantages, t), lm, n_norm, agg)
    loss, zero = pg, torch.zeros((), device=device)
    vf, vf_clip, kl_loss = zero, zero, zero
    if values is not None:
        vf, vf_stats = ops.value_loss(values.float(), take(ro.values, t), take(adv.returns, t), lm,
                                      ppo.clip_range_value, n_norm, **agg)
        loss, vf_clip = loss + ppo.vf_coef * vf, vf_stats["clipfrac"]
    if batch.beta:
        kl = ops.kl_estimate(lp, take(ro.ref_logprobs, t), ppo.kl_estimator)  # (b, T) gradient flows through lp
        kl_loss = ops.aggregate_loss(torch.where(lm, kl, 0.0), lm, ppo.loss_aggregation, n_norm, batch.max_len)
        loss = loss + batch.beta * kl_loss
    if ppo.entropy_coef > 0:
        ent = ops.entropy_from_logits(logits)
        loss = loss - ppo.entropy_coef * ops.aggregate_loss(ent, lm, ppo.loss_aggregation, n_norm, batch.max_len)
    else:
        with torch.no_grad():
            ent = ops.entropy_from_logits(logits)
    dist.backward(loss)
    n = lm.sum().double()
    # The entropy statistic is over every sampled token, not only those in the loss: with groups left out
    # of the loss (ppo.drop_zero_std_groups) a batch of such groups would otherwise log 0 (a "collapse").
    return torch.stack([pg.detach().double(), vf.detach().double(), kl_loss.detach().double(),
                        loss.detach().double(), pg_stats["clipfrac"].double() * n, vf_clip.double() * n,
                        pg_stats["approx_kl"].double() * n, ops.masked_sum(ent.detach(), am).double(), n,
                        am.sum().double()])


def _policy_loss(ppo: PPOConfig, lp: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor, lm: torch.Tensor,
                 n_norm: torch.Tensor, agg: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy loss of ``ppo.policy_loss`` / ``ppo.ratio_level`` / ``ppo.dual_clip`` (docs/algorithms.md),
    normalised like every other term by the global count ``n_norm``."""
    if ppo.policy_loss == "cispo":
        return ops.cispo_loss(lp, old, advantages, lm, ppo.cispo_clip_low, ppo.cispo_clip_high, n_norm, **agg)
    if ppo.ratio_level == "sequence":
        return ops.policy_loss(lp, old, advantages, lm, ppo.sequence_clip_range, n_norm,
                               clip_range_high=ppo.sequence_clip_range_high, ratio_level="sequence",
                               dual_clip=ppo.dual_clip, **agg)
    return ops.policy_loss(lp, old, advantages, lm, ppo.clip_range, n_norm, clip_range_high=ppo.clip_range_high,
                           dual_clip=ppo.dual_clip, **agg)
