"""What the loop carries from one iteration to the next, with the state dicts a checkpoint holds.

``Learner``: the trained model (DDP-wrapped when there are several ranks, or FSDP-sharded with
``model.sharding: fsdp``), its optimizer and LR schedule,
and the guarded optimizer step. ``TrainState``: iteration and step counters, the KL controller, running
reward moments, the prompt sampler and the per-rank minibatch generator. Weights, optimizer tensors and
RNG streams go to safetensors in ``rallyrl.run.checkpoint``; ``TrainState.state_dict`` is the JSON rest.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from .. import dist, ops
from ..config import Config, PPOConfig
from ..data import PromptSampler


@dataclass
class Learner:
    model: torch.nn.Module  # the policy: DDP-wrapped when there are several ranks, or FSDP-sharded in place
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    max_grad_norm: float | None

    @staticmethod
    def create(policy: torch.nn.Module, ppo: PPOConfig, total_steps: int, weights: Any = None) -> "Learner":
        # FSDP: shard first (and fill the shards of a policy built empty: ``weights``, see dist.shard), so
        # the optimizer is built over (and its state sharded like) the shards.
        policy = dist.shard(policy, forward_methods=("run",), weights=weights)  # run: the engine decodes through it
        params = [p for p in policy.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=ppo.lr, eps=ppo.adam_eps, weight_decay=ppo.weight_decay,
                                      fused=_fused_adamw_ok(params) or None)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, functools.partial(ops.lr_multiplier, total=total_steps, warmup=ppo.warmup_steps,
                                         kind=ppo.lr_schedule))
        model, optimizer = dist.prepare(policy, optimizer)
        return Learner(model, optimizer, scheduler, ppo.max_grad_norm)

    @property
    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def step(self, loss: torch.Tensor) -> float | None:
        """Clip and apply the accumulated gradients; returns the (pre-clip) gradient norm.

        A non-finite ``loss`` (this rank's, summed over its micro-batches) or gradient norm never
        reaches the weights: every rank agrees (one all-reduce of two flags) and, if any rank saw one,
        none applies the step and ``None`` is returned. This flag exchange and its ``.tolist()`` are the
        update's one reduction and one host sync per optimizer step.
        """
        # With clipping off, an infinite max norm still returns the (pre-clip) norm for the logs.
        norm = dist.clip_grad_norm(self.model, self.max_grad_norm if self.max_grad_norm is not None else float("inf"))
        bad = dist.all_reduce_sum(torch.stack([~torch.isfinite(loss), ~torch.isfinite(norm)]).double())
        bad_loss, bad_norm, norm_value = torch.cat([bad, norm.detach().double().reshape(1).to(bad.device)]).tolist()
        if bad_loss or bad_norm:
            self.optimizer.zero_grad(set_to_none=True)
            return None
        self.optimizer.step()
        self.scheduler.step()
        return norm_value

    def memory(self, *frozen: torch.nn.Module | None) -> dict[str, float]:
        """``memory/*`` metrics of this rank: bytes of the parameters it holds (the trained model and the
        ``frozen`` ones, e.g. the reference; local shards under FSDP; tied or shared weights once) and
        of the optimizer state. Deterministic (a resumed run logs what the uninterrupted one did), so
        process-level measures such as peak RSS are not logged here (benchmarks measure them)."""
        params = [p for m in (self.model, *frozen) if m is not None for p in m.parameters()]
        state = [t for s in self.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        return {"memory/params_bytes": float(dist.local_nbytes(params)),
                "memory/optimizer_bytes": float(dist.local_nbytes(state))}

    def load_state_dict(self, scheduler_state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict({**self.scheduler.state_dict(), **scheduler_state})

    def apply(self, ppo: PPOConfig) -> None:
        """Make the optimizer use ``ppo``'s settings after a checkpoint restored the old ones: the base lr
        of the schedule (at its current position), eps and weight decay. A no-op when nothing changed:
        ``base_lr * multiplier(step)`` is exactly what the scheduler itself computes."""
        self.scheduler.base_lrs = [ppo.lr for _ in self.optimizer.param_groups]
        factor = self.scheduler.lr_lambdas[0](self.scheduler.last_epoch)
        for g in self.optimizer.param_groups:
            g.update(initial_lr=ppo.lr, lr=ppo.lr * factor, eps=ppo.adam_eps, weight_decay=ppo.weight_decay)
        self.scheduler._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    def scheduler_state(self) -> dict[str, Any]:
        return {k: v for k, v in self.scheduler.state_dict().items() if k != "lr_lambdas"}


def _fused_adamw_ok(params: list[torch.nn.Parameter]) -> bool:
    """Whether torch's fused AdamW kernel takes every parameter (CPU or CUDA, floating point).

    Why: the default (for-loop) AdamW makes ~10 passes over every parameter tensor per step; the fused
    kernel makes one. Same update rule (AdamW, decoupled weight decay), ~4x less optimizer time on CPU:
    0.36 -> 0.09 CPU s per step for SmolLM2-135M (benchmarks/README.md), the default of TRL and of
    transformers' Trainer since torch 2.8 (``adamw_torch_fused``). Rounding differs from the for-loop
    kernel in the last bits, but the run stays deterministic and bit-identical across placements,
    batch splits and resume (the same kernel on every rank and every step).
    """
    return bool(params) and all(p.device.type in ("cpu", "cuda") and p.dtype.is_floating_point for p in params)


@dataclass
class TrainState:
    iteration: int  # iterations completed
    kl_ctl: ops.FixedKLController | ops.AdaptiveKLController
    reward_moments: ops.RunningMoments
    sampler: PromptSampler
    shuffle_gen: torch.Generator  # per-rank minibatch order
    optimizer_steps: int = 0  # applied optimizer steps
    nonfinite_skips: int = 0  # optimizer steps not applied because the loss or gradient norm was NaN/inf

    @staticmethod
    def fresh(cfg: Config, num_prompts: int, shuffle_seed: int) -> "TrainState":
        ppo = cfg.ppo
        kl_ctl = (ops.AdaptiveKLController(ppo.init_kl_coef, ppo.target_kl, ppo.kl_horizon)
                  if ppo.target_kl is not None else ops.FixedKLController(ppo.init_kl_coef))
        return TrainState(iteration=0, kl_ctl=kl_ctl, reward_moments=ops.RunningMoments(),
                          sampler=PromptSampler(num_prompts, cfg.train.seed, cfg.data.shuffle),
                          shuffle_gen=torch.Generator().manual_seed(shuffle_seed))

    def state_dict(self) -> dict[str, Any]:
        """Everything except weights, optimizer, schedule and RNG that later iterations depend on (JSON)."""
        return {"iteration": self.iteration, "optimizer_steps": self.optimizer_steps,
                "nonfinite_skips": self.nonfinite_skips, "kl_ctl": self.kl_ctl.state_dict(),
                "reward_moments": self.reward_moments.state_dict(), "sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.iteration = state["iteration"]
        self.optimizer_steps = state["optimizer_steps"]
        self.nonfinite_skips = state.get("nonfinite_skips", 0)
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        self.reward_moments.load_state_dict(state["reward_moments"])
        self.sampler.load_state_dict(state["sampler"])
