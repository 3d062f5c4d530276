"""Evaluation: the same generation and central reward step as training, plus ``metric_fn`` on the main
rank. It needs samples and rewards only (no policy or reference scoring pass), and it runs inside
``isolated_rng()`` so evaluating never moves the training sampling streams.

With ``eval.samples_per_prompt: k`` every eval prompt is sampled k times: the k·n samples are split over
the ranks like any others (so the k samples of one prompt may sit on different ranks), gathered on the
main rank with their prompt index, and the ``@k`` / ``pass@k`` metrics are computed there by prompt
index (``at_k_metrics``), never from positions in a rank-ordered list."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

from . import dist
from .errors import MetricError
from .inputs import MetricFn, PromptSet
from .reward.step import RewardStep, Samples, call_kwargs
from .rollout import GenerationEngine, SamplingSpec, Shard
from .rollout.collect import episodes
from .rollout.env import EnvSetup
from .rollout.episode import reward_metadata
from .seeding import isolated_rng


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on
    Code", eq. 1): the probability that at least one of k samples, drawn without replacement from n
    samples of which c pass, passes: ``1 - C(n - c, k) / C(n, k)``. Computed as their numerically stable
    product ``1 - prod_{i = n - c + 1}^{n} (1 - k / i)`` (no large binomials)."""
    if not (1 <= k <= n and 0 <= c <= n):
        raise ValueError(f"pass_at_k needs 1 <= k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every draw of k contains a pass
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def at_k_metrics(name: str, values: Sequence[float], prompt_ids: Sequence[int], k: int) -> dict[str, float]:
    """``eval/<name>@<k>`` (mean over all samples) and ``eval/<name>_pass@<k>`` (``pass_at_k`` per prompt,
    a value of exactly 1 being a pass, averaged over prompts) for a metric whose values all lie in
    [0, 1]; {} for any other metric. Samples are grouped by prompt id, in any order."""
    if not values or not all(0.0 <= v <= 1.0 for v in values):  # NaN fails the test too
        return {}
    groups: dict[int, list[float]] = {}
    for pid, v in zip(prompt_ids, values, strict=True):
        groups.setdefault(pid, []).append(v)
    passes = [pass_at_k(len(g), sum(v == 1.0 for v in g), k) for g in groups.values()]
    return {f"eval/{name}@{k}": sum(values) / len(values), f"eval/{name}_pass@{k}": sum(passes) / len(passes)}


@dist.stage("evaluation")
def evaluate(engine: GenerationEngine, tokenizer: Any, reward_step: RewardStep, prompts: PromptSet,
             metric_fn: MetricFn | None, spec: SamplingSpec, chunk_size: int,
             samples_per_prompt: int = 1, env: EnvSetup | None = None) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Every eval prompt ``samples_per_prompt`` times, split over the ranks, through the training
    rollouts' engine (and environment: multi-turn episodes, whose reward includes the environment's own
    rewards and whose turns and tool use are logged as ``eval/turns``, ...); returns the ``eval/*`` metrics
    (on every rank) and the samples with their rewards and metric values (main rank; [] elsewhere)."""
    k = samples_per_prompt
    shard = Shard.even(len(prompts) * k, dist.world_size(), dist.rank(), chunk_size)
    t0 = time.perf_counter()
    # Evaluation must not move the training sampling stream (same guarantee as the reward step). It
    # needs only samples and rewards: no policy/reference scoring pass.
    with isolated_rng():
        samples = _eval_samples(engine, tokenizer, reward_step, prompts, shard, spec, k, env)

    def score() -> dict[str, float]:
        scored = [s["reward"] for s in samples if s["reward"] is not None]  # None: unscorable
        mean = sum(scored) / max(1, len(scored)) if scored or not samples else math.nan  # none scorable: nan
        metrics = {"eval/reward_mean": mean}
        if env is not None:
            metrics |= episode_means([s["episode"] for s in samples], "eval/")
        if metric_fn is None:
            return metrics
        transcripts = [s["episode"] for s in samples] if env is not None else []
        part = Samples([s["prompt"] for s in samples], [s["output"] for s in samples],
                       [s["output_token_ids"] for s in samples],
                       reward_metadata([s["metadata"] for s in samples], transcripts))
        with isolated_rng():
            out = metric_fn([p + o for p, o in zip(part.prompts, part.outputs)], part.prompts,
                            part.outputs, **call_kwargs(part, tokenizer))
        if not isinstance(out, dict):
            raise TypeError(f"metric_fn must return a dict of name -> per-sample values, got {type(out).__name__}")
        for name, vals in out.items():
            vals = list(vals)
            metrics[f"eval/{name}"] = sum(float(v) for v in vals) / max(1, len(vals))
            for s, v in zip(samples, vals):
                s[name] = float(v)
            if k > 1:
                if len(vals) != len(samples):
                    raise ValueError(f"metric_fn returned {len(vals)} values for {name!r}, one per sample "
                                     f"expected ({len(samples)})")
                metrics |= at_k_metrics(name, [float(v) for v in vals], [s["index"] for s in samples], k)
        return metrics

    metrics = dist.agree(score, MetricError, main_only=True)
    metrics["time/eval"] = time.perf_counter() - t0
    return metrics, samples


def _eval_samples(engine: GenerationEngine, tokenizer: Any, reward_step: RewardStep, prompts: PromptSet,
                  shard: Shard, spec: SamplingSpec, k: int = 1, env: EnvSetup | None = None) -> list[dict[str, Any]]:
    """Every eval sample with its reward, gathered on the main rank ([] elsewhere). Eval sample ``j`` is
    sample ``j % k`` of prompt ``j // k``; with k > 1 its record carries ``sample`` (that member index)."""
    local: list[dict[str, Any]] = []
    for r in range(shard.rounds):
        items = shard.round(r)
        mine = [j // k for j in items]  # prompt indices (k = 1: the items themselves)
        g = episodes(engine, tokenizer, prompts, mine, spec, env)
        texts, metadata = prompts.texts(mine), prompts.metadata(mine)
        rewards, _ = reward_step(Samples(texts, g.outputs, g.response_lists, reward_metadata(metadata, g.transcripts)))
        local += [{"index": i, "prompt": p, "output": o, "reward": rw.total, "output_token_ids": t, "metadata": md}
                  | ({"sample": j % k} if k > 1 else {})
                  for j, i, p, o, rw, t, md in zip(items, mine, texts, g.outputs, rewards, g.response_lists, metadata)]
        for s, t in zip(local[len(local) - len(g.transcripts):] if g.transcripts else [], g.transcripts):
            s["episode"] = t  # the environment's rewards count in the episode's reward
            s["reward"] += sum(r for r in t["env_rewards"] if r is not None)
    gathered = dist.gather_objects(local, dst=0)
    return [s for part in gathered or [] for s in part]


def episode_means(transcripts: Sequence[dict[str, Any] | None], prefix: str) -> dict[str, float]:
    """Per-episode means of a list of transcripts (None entries skipped): turns, tool calls, tool errors,
    the truncated fraction and forks, as ``<prefix>turns``, ..."""
    ts = [t for t in transcripts if t is not None]
    n = max(1, len(ts))
    calls = [c for t in ts for turn in t["turns"] for c in turn["tool_calls"]]
    return {f"{prefix}turns": sum(len(t["turns"]) for t in ts) / n, f"{prefix}tool_calls": len(calls) / n,
            f"{prefix}tool_errors": sum(c["error"] is not None for c in calls) / n,
            f"{prefix}truncated": sum(bool(t["truncated"]) for t in ts) / n, f"{prefix}forks": sum(t["forks"] for t in ts) / n}
