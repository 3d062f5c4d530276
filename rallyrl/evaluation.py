"""Evaluation: the same generation and central reward step as training, plus ``metric_fn`` on the main
rank. It needs samples and rewards only (no policy or reference scoring pass), and it runs inside
``isolated_rng()`` so evaluating never moves the training sampling streams."""

from __future__ import annotations

import time
from typing import Any

import torch

from . import dist
from .config import GenerationConfig
from .errors import MetricError
from .inputs import MetricFn, PromptSet
from .models import LoadedModels
from .reward.step import RewardStep, Samples, call_kwargs
from .rollout import Shard, generate
from .seeding import isolated_rng


@dist.stage("evaluation")
def evaluate(models: LoadedModels, reward_step: RewardStep, prompts: PromptSet, metric_fn: MetricFn | None,
             gen: GenerationConfig, do_sample: bool, chunk_size: int, device: torch.device
             ) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Every eval prompt once, split over the ranks; returns the ``eval/*`` metrics (on every rank) and
    the samples with their rewards and metric values (main rank; [] elsewhere)."""
    shard = Shard.even(len(prompts), dist.world_size(), dist.rank(), chunk_size)
    t0 = time.perf_counter()
    # Evaluation must not move the training sampling stream (same guarantee as the reward step). It
    # needs only samples and rewards: no policy/reference scoring pass.
    with isolated_rng():
        samples = _eval_samples(models, reward_step, prompts, shard, gen, do_sample, device)

    def score() -> dict[str, float]:
        metrics = {"eval/reward_mean": sum(s["reward"] for s in samples) / max(1, len(samples))}
        if metric_fn is None:
            return metrics
        part = Samples([s["prompt"] for s in samples], [s["output"] for s in samples],
                       [s["output_token_ids"] for s in samples], [s["metadata"] for s in samples])
        with isolated_rng():
            out = metric_fn([p + o for p, o in zip(part.prompts, part.outputs)], part.prompts,
                            part.outputs, **call_kwargs(part, models.tokenizer))
        if not isinstance(out, dict):
            raise TypeError(f"metric_fn must return a dict of name -> per-sample values, got {type(out).__name__}")
        for name, vals in out.items():
            vals = list(vals)
            metrics[f"eval/{name}"] = sum(float(v) for v in vals) / max(1, len(vals))
            for s, v in zip(samples, vals):
                s[name] = float(v)
        return metrics

    metrics = dist.agree(score, MetricError, main_only=True)
    metrics["time/eval"] = time.perf_counter() - t0
    return metrics, samples


def _eval_samples(models: LoadedModels, reward_step: RewardStep, prompts: PromptSet, shard: Shard,
                  gen: GenerationConfig, do_sample: bool, device: torch.device) -> list[dict[str, Any]]:
    """Every eval sample with its reward, gathered on the main rank ([] elsewhere)."""
    local: list[dict[str, Any]] = []
    for r in range(shard.rounds):
        mine = shard.indices[r * shard.chunk_size : (r + 1) * shard.chunk_size]
        g = generate(models.policy, models.tokenizer, prompts.token_ids(mine), gen, do_sample, device)
        texts, metadata = prompts.texts(mine), prompts.metadata(mine)
        rewards, _ = reward_step(Samples(texts, g.outputs, g.response_lists, metadata))
        local += [{"index": i, "prompt": p, "output": o, "reward": rw.total, "output_token_ids": t, "metadata": md}
                  for i, p, o, rw, t, md in zip(mine, texts, g.outputs, rewards, g.response_lists, metadata)]
    gathered = dist.gather_objects(local, dst=0)
    return [s for part in gathered or [] for s in part]
