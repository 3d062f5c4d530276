"""The PPO loop, as named stages.

    collect rollouts (G completions per prompt) -> central reward step -> advantages (``ppo.estimator``:
    KL-shaped rewards + GAE, or the critic-free group statistics of GRPO / RLOO) -> PPO epochs
    -> log / eval / checkpoint

``train()`` reads top to bottom like a recipe; each stage is a function that takes what it uses (a
``GenerationConfig``, a ``PPOConfig``, a ``Shard`` of the batch plan), not the whole config. Single- and
multi-process runs execute the same code (every collective in ``dist`` is a no-op at world size 1).
Statistics that define the update (advantage whitening, reward scaling, the loss normaliser) are global
over all ranks, so N processes compute what one process would on the same samples.

The models are reached only through the ``Policy`` / ``Reference`` protocols (``rallyrl.models``):
nothing here knows whether the policy is a causal LM or a seq2seq model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from . import dist, ops
from .config import BatchPlan, Config, PPOConfig, engine_logprobs_exact, load_config
from .errors import NonFiniteError, raise_if_interrupted
from .evaluation import evaluate
from .inputs import Inputs, MetricFn, PromptSet, PromptSource, eval_steps, prepare_inputs
from .learn.advantages import compute_advantages
from .learn.engine import engine_correction
from .learn.metrics import iteration_metrics
from .learn.state import Learner, TrainState
from .learn.update import ppo_update
from .models import LoadedModels, load_models
from .reward.local_server import LocalRewardServer
from .reward.step import RewardStep, StepStats
from .rollout import Advantages, GenerationEngine, HFEngine, Rollouts, SamplingSpec, Shard, collect_rollouts
from .rollout.dynamic import sample_groups
from .rollout.env import EnvRunner, EnvSetup
from .run import checkpoint as ckpt
from .run.console import RunLog, TrainResult
from .run.lock import releases_run_dir_lock
from .run.rundir import RunDir
from .run.stage import checkpoint_stage, save_final
from .seeding import seed_everything, stream_seed

__all__ = ["Advantages", "TrainResult", "collect_rollouts", "compute_advantages", "ppo_update", "train"]


# ------------------------------------------------------------------------------------------------
# The recipe


@releases_run_dir_lock  # the run-dir lock (main rank, RunDir.check_start) ends with this call, however it ends
def train(config: Config | dict | str | Path | None = None, reward_fn: Callable | Sequence[Callable] | None = None,
          prompts: PromptSource | None = None, eval_prompts: PromptSource | None = None,
          metric_fn: MetricFn | None = None, overrides: Sequence[str] | None = None,
          callbacks: Sequence[Any] | None = None, env: Any = None) -> TrainResult:
    """Fine-tune ``model.path`` with PPO, GRPO or RLOO (``ppo.estimator``), like ``trlx.train``; every rank
    calls it. ``reward_fn``, ``prompts``, ``eval_prompts``, ``metric_fn`` override ``reward.fn``, ``data.*``,
    ``eval.metric_fn`` (trlx signature ``fn(samples, prompts, outputs, **kwargs)``); ``prompts`` /
    ``eval_prompts`` take what ``data.prompts`` takes or a ``datasets.Dataset`` / ``DatasetDict``;
    docs/data.md, docs/tracking.md. ``env`` (overrides ``env.factory``): the environment of multi-turn
    episodes, a class or a function that returns a fresh environment per episode (docs/environments.md)."""
    # One function on purpose (~65 lines): the loop's stages read top to bottom as a recipe, each a call;
    # splitting the loop body would hide the order of the stages, which is what a reader comes here for.
    cfg = load_config(config, list(overrides or []))
    inp = prepare_inputs(cfg, dist.expected_world_size(), reward_fn, metric_fn, prompts, eval_prompts, env)
    evals = set(eval_steps(cfg)) if len(inp.eval_set) else set()
    run_dir = RunDir.check_start(Path(cfg.train.run_dir), cfg, sorted(evals), lock=True)  # before anything heavy
    device = dist.init_accelerator(cfg.dist.timeout_s, cfg.model.sharding, cfg.train.mixed_precision)
    with _reward_host(cfg, inp) as reward_step, _environment(cfg, inp) as env:  # both end however this ends
        models, learner, state = _build(cfg, inp, device)
        resumed_from, was_world_size = _resume(run_dir, cfg, models, learner, state)
        engine, spec = _engine(cfg, models, state, device)  # hf: the policy's own weights; vllm: a pushed copy
        log = RunLog(run_dir.open(cfg, resumed_from, state.iteration, was_world_size), cfg, state.iteration,
                     TrainResult(run_dir.path), callbacks)
        log.start(inp.plan, cfg, resumed_from, state.iteration, was_world_size)
        reward_step.notice = log.waiting  # "waiting for the reward on rank 0, 42 s" on the progress line
        run_eval = functools.partial(_evaluate, models, engine, reward_step, inp, cfg, device, log, env)
        try:
            reward_step.open()  # `reward.server: local`: rank 0 waits for its server to answer (a collective)
            if resumed_from is None and 0 in evals:
                log.eval_before(run_eval(0))
            for step in range(state.iteration + 1, cfg.train.iterations + 1):
                t_iter = time.perf_counter()
                raise_if_interrupted()  # a Ctrl-C whose exception Python dropped (see errors.py) stops here
                # 1-2. rollouts (G completions or episodes of each drawn prompt; DAPO's rounds with
                # rollout.dynamic_sampling) + the central reward step
                ro, rstats, times = _rollouts(models, engine, reward_step, inp, state, spec, cfg, device, env)
                # 3-4. advantages of ppo.estimator (gae: KL-shaped rewards + GAE; grpo/rloo: group statistics)
                adv = compute_advantages(ro, state, cfg.ppo)
                # vllm: the engine/trainer mismatch (engine/*) and ppo.engine_correction on the advantages
                adv, engine_metrics = engine_correction(ro, adv, cfg.ppo, state.iteration)
                # 5. PPO epochs (a non-finite loss or gradient norm is never applied)
                upd = ppo_update(learner, ro, adv, state, cfg.ppo, cfg.generation.temperature,
                                 cfg.generation.max_new_tokens, device)
                engine_metrics |= _sync(engine, models.policy)  # the next samples come from the updated weights
                # 6. statistics (one all-reduce), KL controller, logs, eval
                metrics = _statistics(ro, adv, rstats, upd, times, inp, state, learner, models, step, cfg, run_dir)
                metrics |= engine_metrics
                log.rollouts(ro, adv.seq_advantages, step, dist.rank())  # unless train.log_rollouts is off
                if step in evals:
                    metrics |= run_eval(step)
                state.iteration = step
                stop = log.iteration(step, metrics | {"time/iteration": time.perf_counter() - t_iter})  # callbacks
                # 7. checkpoint (collective, atomic); SIGTERM/SIGUSR1 on any rank: all stop here (checkpoint.on_signal)
                checkpoint_stage(run_dir, step, models.policy, learner, state, cfg.checkpoint, stopping=stop)
                if stop:  # a callback's "stop", broadcast: every rank leaves after this iteration
                    break
            log.close()
            if cfg.train.save_final:
                save_final(run_dir, models.policy, models.tokenizer, log.result)
            dist.barrier()  # every rank leaves together (a peer still receiving the last broadcast must not see us go)
        except KeyboardInterrupt as stop:
            log.interrupted(state.iteration, run_dir.newest_checkpoint(), stop)
            raise
        finally:
            log.close()
            if hasattr(engine, "close"):
                engine.close()
    return log.result


# ------------------------------------------------------------------------------------------------
# helpers of the recipe


def _build(cfg: Config, inp: Inputs, device: torch.device) -> tuple[LoadedModels, Learner, TrainState]:
    """Models, optimizer + schedule and the fresh train state (seeded: see ``rallyrl.seeding``)."""
    W, R = dist.world_size(), dist.rank()
    assert inp.plan.world_size == W, f"inputs were checked for {inp.plan.world_size} processes, the group has {W}"
    torch.set_num_threads(num_threads(cfg.train.num_threads))
    torch.manual_seed(cfg.train.seed)  # shared: any random init inside from_pretrained matches on all ranks
    # FSDP: built empty (no weights read), then each model is sharded and rank 0 alone reads the weights
    # into the shards (models/weights.py); DDP: loaded whole on every rank.
    models = _quiet(load_models, cfg.model, cfg.train.seed, inp.tokenizer, not cfg.ppo.critic_free,
                    cfg.ppo.uses_reference, dist.is_sharded())
    if models.note and dist.is_main():
        print(f"rallyrl: note: model.sharding: fsdp: {models.note}", file=sys.stderr, flush=True)
    if models.weights is None:
        models.policy.to(device)
        if models.reference is not None:
            models.reference.to(device)
    if models.reference is not None:  # FSDP: sharded (and filled); DDP: as is
        models.reference = dist.shard(models.reference, forward_methods=("logprobs",), weights=models.weights)
    seed_everything(cfg.train.seed, R)  # per-rank: generation sampling
    total_steps = cfg.train.iterations * inp.plan.optimizer_steps_per_iteration
    learner = Learner.create(models.policy, cfg.ppo, total_steps, weights=models.weights)
    state = TrainState.fresh(cfg, len(inp.train_set), shuffle_seed=stream_seed(cfg.train.seed, "minibatch", R))
    return models, learner, state


def num_threads(configured: int) -> int:
    """torch intra-op threads for this process: ``train.num_threads``, else ``OMP_NUM_THREADS`` when it is set
    (a user's or scheduler's choice, as torch itself honours it), else the cores shared out over the local
    processes."""
    if configured:
        return configured
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) > 0:
        return int(omp)
    return max(1, (os.cpu_count() or 1) // dist.local_world_size())


@contextlib.contextmanager
def _reward_host(cfg: Config, inp: Inputs) -> Iterator[RewardStep]:
    """The run's reward step; with ``reward.server: local`` rank 0's server is spawned on entry and
    stopped on exit (also when loading, resuming or training fails, or on Ctrl-C), and background reward
    threads end there too."""
    step = _reward_step(cfg, inp)
    step.launch_server()
    try:
        yield step
    finally:
        step.close()


def _sync(engine: GenerationEngine, policy: Any) -> dict[str, float]:
    """``engine.sync`` after the optimizer phase: a no-op for the HF engine (it runs the policy's own
    weights); vllm pushes and probes them, and reports ``engine/*`` and ``time/engine_sync``."""
    t_sync = time.perf_counter()
    engine.sync(policy)
    if not hasattr(engine, "stats"):  # only an engine with its own copy of the weights has any
        return {}
    return engine.stats() | {"time/engine_sync": time.perf_counter() - t_sync}


def _next_shard(plan: BatchPlan, state: TrainState, prompts: PromptSet) -> Shard:
    """This rank's part of the next iteration: ``num_rollouts / G`` prompts drawn from the shared
    sampler (the same on every rank), each repeated G times in a row (group g = samples g*G..g*G+G-1).
    Every rank prepares (reads, renders, tokenizes, checks) all the drawn prompts, not only its own: a
    prompt that is too long or empty then raises the same error naming its row on every rank, at the
    same point, with no collective; and only this iteration's rows stay in memory."""
    drawn = prompts.draw(state.sampler, plan.prompts_per_iteration)  # data.long_prompts: skip draws on
    return Shard.of_plan(plan, dist.rank(), plan.sample_prompts(drawn))


def _rollouts(models: LoadedModels, engine: GenerationEngine, reward_step: RewardStep, inp: Inputs,
              state: TrainState, spec: SamplingSpec, cfg: Config, device: torch.device,
              env: EnvSetup | None) -> tuple[Rollouts, StepStats, dict[str, float]]:
    """The iteration's rollouts: one draw of prompts, or with ``rollout.dynamic_sampling`` DAPO's rounds of
    draws until the batch holds enough groups whose rewards differ (rollout/dynamic.py). Each round's scores
    carry ``reward.overlong_buffer``'s penalty before anything reads them."""
    ob = cfg.reward.overlong_buffer

    def collect(shard: Shard) -> tuple[Rollouts, StepStats, dict[str, float]]:
        ro, rstats, times = collect_rollouts(models, engine, reward_step, inp.train_set, shard, spec, device,
                                             from_generation=cfg.rollout.logprobs_from == "generate", env=env)
        if ob is not None:  # a reward component of its own (reward/overlong), on every sample
            lengths = ro.action_mask.sum(1)  # (B,) the tokens the policy sampled
            ro.add_reward("overlong", ops.overlong_penalty(lengths, cfg.generation.max_new_tokens, ob.length,
                                                           ob.penalty))
        return ro, rstats, times

    if not cfg.rollout.dynamic_sampling:
        return collect(_next_shard(inp.plan, state, inp.train_set))  # every rank reads the drawn prompts
    drew: dict[str, float] = {}  # data/* of every round's draw (the prompt set reports its last draw's only)

    def draw() -> Shard:
        shard = _next_shard(inp.plan, state, inp.train_set)
        for k, v in inp.train_set.draw_metrics().items():
            drew[k] = drew.get(k, 0.0) + v
        return shard

    ro, rstats, metrics = sample_groups(draw, collect, inp.plan, cfg.rollout.max_sampling_rounds,
                                        cfg.ppo.reward_clip, models.tokenizer.pad_token_id)
    return ro, rstats, metrics | drew


def _engine(cfg: Config, models: LoadedModels, state: TrainState,
            device: torch.device) -> tuple[GenerationEngine, SamplingSpec]:
    """The generation engine and the training rollouts' sampling spec. The engine's weight version is the
    number of optimizer phases behind its weights (a resumed run continues the count)."""
    gen = cfg.generation
    spec = SamplingSpec.of(gen, gen.do_sample, models.tokenizer, logprobs=cfg.rollout.logprobs_from == "generate")
    if gen.engine == "hf":
        return HFEngine(models.policy, models.tokenizer, device, gen.prefill_once, version=state.iteration), spec
    from .rollout.vllm import VLLMEngine

    # The engine's log-probs are recorded whenever they mean what the trainer's do (full vocabulary at the
    # sampling temperature: config.engine_logprobs_exact; the config refuses what needs them otherwise).
    exact = engine_logprobs_exact(gen, gen.do_sample)
    mode = "raw_logprobs" if gen.top_k > 0 or gen.top_p < 1.0 or not gen.do_sample else "processed_logprobs"
    engine = VLLMEngine.start(models.policy, models.tokenizer, cfg.model.path, gen, cfg.model.dtype, mode, device,
                              version=state.iteration,
                              trainer_dtype="bfloat16" if cfg.train.mixed_precision == "bf16" else cfg.model.dtype)
    return engine, dataclasses.replace(spec, logprobs=exact,
                                       seed=stream_seed(cfg.train.seed, "engine_sampling", dist.rank()))


def _evaluate(models: LoadedModels, engine: GenerationEngine, reward_step: RewardStep, inp: Inputs, cfg: Config,
              device: torch.device, log: RunLog, env: EnvSetup | None, step: int) -> dict[str, float]:
    spec = SamplingSpec.of(cfg.generation, cfg.eval.do_sample, models.tokenizer)
    if cfg.generation.engine != "hf":  # an engine with its own sampler: its own per-rank eval stream
        spec = dataclasses.replace(spec, seed=stream_seed(cfg.train.seed, "engine_eval", dist.rank()))
    return log.eval(step, *evaluate(engine, models.tokenizer, reward_step, inp.eval_set, inp.metric_fn, spec,
                                    cfg.rollout.chunk_size, cfg.eval.samples_per_prompt, env))


@contextlib.contextmanager
def _environment(cfg: Config, inp: Inputs) -> Iterator[EnvSetup | None]:
    """Multi-turn episodes' environment settings and this process's tool runner (its event-loop thread
    stops on exit); None for single-turn episodes. Each episode's environment comes from ``inp.env``.
    The budget of a row is ``rollout.max_episode_tokens``, never more than the model's positions (nor, with
    the vLLM engine, its ``max_model_len``: it refuses a longer context); a turn's steps may take at most
    ``dist.timeout_s`` (the time the other ranks would wait)."""
    if inp.env is None:
        yield None
        return
    e = cfg.env
    engine_len = cfg.generation.vllm.max_model_len if cfg.generation.engine == "vllm" else None
    limits = [x for x in (cfg.rollout.max_episode_tokens, inp.max_positions, engine_len) if x is not None]
    budget = min(limits) if limits else None
    runner = EnvRunner(e.tool_timeout_s, e.max_concurrent_tools, e.on_tool_error, turn_timeout_s=cfg.dist.timeout_s)
    setup = EnvSetup(inp.env, runner, e.max_turns, budget, e.turn_rewards, e.on_template_drift)
    try:
        yield setup
    finally:
        setup.close()


def _statistics(ro: Rollouts, adv: Advantages, rstats: StepStats, upd: dict[str, float], times: dict[str, float],
                inp: Inputs, state: TrainState, learner: Learner, models: LoadedModels, step: int, cfg: Config,
                run_dir: RunDir) -> dict[str, float]:
    """The iteration's metrics (one all-reduce), the non-finite guard and the KL controller's update."""
    names = [f.name for f in inp.reward_fns] + (["overlong"] if cfg.reward.overlong_buffer is not None else [])
    metrics = iteration_metrics(ro, adv, rstats, upd, names, state, inp.plan)
    # (with dynamic sampling, times carries data/* summed over the rounds' draws instead of the last draw's)
    drawn = {} if cfg.rollout.dynamic_sampling else inp.train_set.draw_metrics()
    metrics |= times | {"policy/lr": learner.lr, "time/update": upd["time"]} | drawn
    metrics |= learner.memory(models.reference)  # this rank's bytes (rank 0's are logged)
    _check_finite(metrics, upd, step, cfg.ppo, run_dir)
    if "policy/kl" in metrics:  # no reference (beta 0, fixed): nothing to control
        state.kl_ctl.update(metrics["policy/kl"], inp.plan.num_rollouts)
    return metrics


def _reward_step(cfg: Config, inp: Inputs) -> RewardStep:
    """The central reward step (docs/reward.md, docs/reward-server.md). ``reward.timeout_s`` bounds each
    in-process reward call; a ``RemoteReward`` (``reward.url``, ``reward.server: local``) applies it per
    HTTP attempt itself, so it is not bounded twice. With ``reward.server: local`` the step carries the
    server (``launch_server()`` spawns it on rank 0, ``open()`` waits for it, ``close()`` stops it)."""
    r = cfg.reward
    server, remote_options = None, {}
    if r.server == "local":
        # The server must come up before the other ranks give up waiting for it in open()'s broadcast.
        signature = ["--signature", r.signature] if r.signature != "auto" else []  # the server calls the function
        server = LocalRewardServer(r.fn or "", r.kwargs, [*r.server_args, *signature],
                                   startup_timeout_s=min(300.0, 0.8 * cfg.dist.timeout_s))
        remote_options = {"timeout_s": r.timeout_s if r.timeout_s is not None else 60.0, "retries": r.retries}
    return RewardStep(inp.reward_fns, r.placement, r.batch_size, inp.tokenizer, timeout_s=r.timeout_s,
                      overlap=r.overlap, server=server, remote_options=remote_options)


def _resume(run_dir: RunDir, cfg: Config, models: LoadedModels, learner: Learner,
            state: TrainState) -> tuple[Path | None, int | None]:
    """Restore the run from the checkpoint the main rank picks (so every rank loads the same one).
    Returns the checkpoint and the number of processes that wrote it (None, None for a fresh start)."""
    path = run_dir.resume_point(cfg.train)
    if path is None:
        return None, None
    saved = ckpt.load_checkpoint(path, models.policy, learner.optimizer, state.shuffle_gen)
    state.load_state_dict(saved)
    learner.load_state_dict(saved["scheduler"])
    # The config's optimizer settings win over the checkpoint's (identical unless a change was allowed,
    # in which case the new lr really takes effect; the schedule's position carries over).
    learner.apply(cfg.ppo)
    R = dist.rank()
    if saved["world_size"] != dist.world_size():
        # Another number of processes: what is global (weights, optimizer, schedule, KL controller,
        # reward moments, the shared prompt sampler) carried over above; rank R's saved streams drew for
        # another split of the batch, so every rank starts its streams afresh at this iteration.
        seed_everything(cfg.train.seed, R, iteration=state.iteration)
        state.shuffle_gen.manual_seed(stream_seed(cfg.train.seed, "minibatch", R, iteration=state.iteration))
    elif any(c.key == "train.seed" for c in run_dir.changes):  # an allowed seed change: new streams from here
        seed_everything(cfg.train.seed, R)
        state.shuffle_gen.manual_seed(stream_seed(cfg.train.seed, "minibatch", R))
    run_dir.truncate_logs(state.iteration)
    return path, saved["world_size"]


def _check_finite(metrics: dict[str, float], upd: dict[str, float], step: int, ppo: PPOConfig,
                  run_dir: RunDir) -> None:
    """Every rank holds the same reduced metrics, so every rank stops here together."""
    if upd["skipped"] and metrics["policy/nonfinite_skips"] > ppo.max_nonfinite_skips:
        newest = run_dir.newest_checkpoint()
        raise NonFiniteError(
            f"iteration {step}: the loss or the gradient norm became NaN/inf in {int(upd['skipped'])} "
            f"optimizer step(s); those steps were not applied (weights are unchanged by them). Newest "
            f"checkpoint: {newest or 'none'}"
            + ("; resume with --set train.resume=latest" if newest else "")
            + ". Lower ppo.lr, clip rewards (ppo.reward_clip) or allow skips with ppo.max_nonfinite_skips")


def _quiet(fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn`` without transformers' per-file progress bars (noise in multi-process logs)."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        return fn(*args)
    finally:
        if was:
            hf_logging.enable_progress_bar()
