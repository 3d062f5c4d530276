"""The rollout stage: episodes for every chunk round, the central reward step, the scoring passes."""

from __future__ import annotations

import time

import torch

from .. import dist
from ..errors import EpisodeError
from ..data import PromptSet
from ..models import LoadedModels
from ..reward.step import RewardStep, Samples, StepStats
from .batch import Rollouts, Shard
from .engine import GenerationEngine, SamplingSpec
from .env import EnvSetup
from .episode import Episodes, env_records, reward_metadata, run_env_episodes, run_episodes
from .scoring import score_tokens


@dist.stage("rollout stage (generation and the central reward step)")
def collect_rollouts(models: LoadedModels, engine: GenerationEngine, reward_step: RewardStep, prompts: PromptSet,
                     shard: Shard, spec: SamplingSpec, device: torch.device,
                     from_generation: bool | None = None,
                     env: EnvSetup | None = None) -> tuple[Rollouts, StepStats, dict[str, float]]:
    """Each chunk round: run its episodes, submit the round to the central reward step, run the
    log-prob/value passes (the policy's part comes from the engine when ``spec.logprobs``:
    ``rollout.logprobs_from: generate``). The rewards are collected once, after the last round (with
    ``reward.overlap`` the reward host scores round r while every rank works on round r + 1; without it
    each round's step is synchronous and ``collect`` only hands its results back). Nothing here draws
    random numbers but the engine, so both ways give the same rollouts.

    ``from_generation`` (default ``spec.logprobs``): the engine's log-probs are the old log-probs
    (``rollout.logprobs_from: generate``). False while ``spec.logprobs`` is set: a separate engine's
    log-probs are recorded beside the trainer's (``Rollouts.engine_logprobs``)."""
    from_generation = spec.logprobs if from_generation is None else from_generation
    handles, pending = [], []
    t_start, t_gen, t_fwd = time.perf_counter(), 0.0, 0.0
    for r in range(shard.rounds):
        mine = shard.round(r)  # may be empty on some ranks
        texts, metadata = prompts.texts(mine), prompts.metadata(mine)
        t0 = time.perf_counter()
        ep = episodes(engine, models.tokenizer, prompts, mine, spec, env)
        t_gen += time.perf_counter() - t0
        samples = Samples(texts, ep.outputs, ep.response_lists, reward_metadata(metadata, ep.transcripts))
        handles.append(reward_step.submit(samples))  # a collective
        t0 = time.perf_counter()
        # every rank calls it (under fsdp it gathers the weights: a collective); None for an empty chunk
        scored = score_tokens(models.policy, models.reference, ep, spec.temperature, device, from_generation)
        t_fwd += time.perf_counter() - t0
        if scored is not None:
            first = shard.first_index + r * shard.chunk_size
            pending.append((r, ep, scored, texts, metadata, list(range(first, first + len(mine)))))
    results = reward_step.collect(handles)  # a collective; a failure in any round raises here on every rank
    total = StepStats()
    for _, st in results:
        total.add(st)
    chunks = [Rollouts.from_chunk(ep, scored, results[r][0], texts, metadata, index, shard.group_size)
              for r, ep, scored, texts, metadata, index in pending]
    ro = Rollouts.concat(chunks, models.tokenizer.pad_token_id)
    return ro, total, {"time/generate": t_gen, "time/forward": t_fwd, "time/rollout": time.perf_counter() - t_start}


def episodes(engine: GenerationEngine, tokenizer: object, prompts: PromptSet, rows: list[int], spec: SamplingSpec,
             env: EnvSetup | None) -> Episodes:
    """One chunk round's episodes (every rank, every round, ``rows`` possibly empty): single turn without an
    environment; with one, multi-turn episodes whose failure on any rank (an environment or tool error, a
    template that is not prefix-preserving) is raised as the same ``EpisodeError`` on every rank, before
    any rank enters the reward step's collective (one all-gather per round, only with an environment)."""
    if env is None:
        return run_episodes(engine, tokenizer, prompts.token_ids(rows), spec)
    records = env_records(prompts.texts(rows), prompts.metadata(rows))
    return dist.agree(lambda: run_env_episodes(engine, tokenizer, records, rows, spec, env), EpisodeError,
                      what="multi-turn episode")
