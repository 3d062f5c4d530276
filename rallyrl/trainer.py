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
import functools
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import dist, ops
from .config import BatchPlan, Config, GenerationConfig, PPOConfig, load_config
from .errors import NonFiniteError, raise_if_interrupted
from .evaluation import evaluate
from .inputs import Inputs, MetricFn, PromptSet, eval_steps, prepare_inputs
from .metrics import iteration_metrics
from .models import LoadedModels, load_models
from .reward.local_server import LocalRewardServer
from .reward.step import RewardStep, Samples, StepStats
from .rollout import Advantages, Rollouts, Shard, generate, score_tokens
from .run import checkpoint as ckpt
from .run.console import RunLog, TrainResult
from .run.lock import releases_run_dir_lock
from .run.rundir import RunDir
from .seeding import seed_everything, stream_seed
from .state import Learner, TrainState

__all__ = ["Advantages", "TrainResult", "collect_rollouts", "compute_advantages", "ppo_update", "train"]


# ------------------------------------------------------------------------------------------------
# Stage 1+2: collect rollouts, with the central reward step once per chunk round


@dist.stage("rollout stage (generation and the central reward step)")
def collect_rollouts(models: LoadedModels, reward_step: RewardStep, prompts: PromptSet, shard: Shard,
                     gen: GenerationConfig, do_sample: bool, device: torch.device, from_generation: bool = False
                     ) -> tuple[Rollouts, StepStats, dict[str, float]]:
    """Each chunk round: generate, submit the round to the central reward step, run the log-prob/value
    passes. The rewards are collected once, after the last round (with ``reward.overlap`` the reward
    host scores round r while every rank works on round r + 1; without it each round's step is
    synchronous and ``collect`` only hands its results back). Nothing here draws random numbers but
    ``generate``, so both ways give the same rollouts."""
    handles, pending = [], []
    t_start, t_gen, t_fwd = time.perf_counter(), 0.0, 0.0
    for r in range(shard.rounds):
        mine = shard.indices[r * shard.chunk_size : (r + 1) * shard.chunk_size]  # may be empty on some ranks
        texts, metadata = prompts.texts(mine), prompts.metadata(mine)
        t0 = time.perf_counter()
        g = generate(models.policy, models.tokenizer, prompts.token_ids(mine), gen, do_sample, device,
                     scored=from_generation)
        t_gen += time.perf_counter() - t0
        handles.append(reward_step.submit(Samples(texts, g.outputs, g.response_lists, metadata)))  # a collective
        t0 = time.perf_counter()
        # every rank calls it (under fsdp it gathers the weights: a collective); None for an empty chunk
        scored = score_tokens(models.policy, models.reference, g, gen.temperature, device, from_generation)
        t_fwd += time.perf_counter() - t0
        if scored is not None:
            first = shard.first_index + r * shard.chunk_size
            pending.append((r, g, scored, texts, metadata, list(range(first, first + len(mine)))))
    results = reward_step.collect(handles)  # a collective; a failure in any round raises here on every rank
    total = StepStats()
    for _, st in results:
        total.add(st)
    chunks = [Rollouts.from_chunk(g, scored, results[r][0], texts, metadata, index, shard.group_size)
              for r, g, scored, texts, metadata, index in pending]
    ro = Rollouts.concat(chunks, models.tokenizer.pad_token_id)
    return ro, total, {"time/generate": t_gen, "time/forward": t_fwd, "time/rollout": time.perf_counter() - t_start}


# ------------------------------------------------------------------------------------------------
# Stage 3+4: reward shaping and advantages (the estimator is chosen here, not in train())


@dist.stage("advantage estimation")
def compute_advantages(ro: Rollouts, state: TrainState, ppo: PPOConfig) -> Advantages:
    """``gae``: per-token KL-shaped rewards, GAE over the value head's values, optional global whitening.
    ``grpo``/``rloo``: one outcome score per sequence (score + its dense rewards; minus beta * its KL with
    ``kl_in: reward``), turned into advantages by ``ops.group_advantages`` over the GLOBAL batch, by
    group id: every rank gathers every sample's (index, group, score), so the statistics are the same
    whichever rank scored which sample and however groups straddle ranks (docs/algorithms.md)."""
    scores, dense = _scaled_scores(ro, state, ppo)
    m = ro.response_mask
    kl_tok = seq_kl = None
    if ro.ref_logprobs is not None:
        kl_tok = ops.kl_estimate(ro.logprobs, ro.ref_logprobs, ppo.kl_estimator) * m  # (B, T)
        seq_kl = (ro.logprobs - ro.ref_logprobs).mul(m).sum(1)  # (B,) k1 per sequence (the logged KL)
    beta = state.kl_ctl.value if ppo.kl_in == "reward" else 0.0
    if not ppo.critic_free:
        kl = kl_tok if kl_tok is not None else torch.zeros_like(ro.logprobs)
        rewards = ops.penalized_rewards(kl, m, beta, scores, dense)  # (B, T)
        adv, returns = ops.gae(rewards, ro.values, m, ppo.gamma, ppo.lam)  # (B, T)
        if ppo.whiten_advantages:
            # Global statistics: whitening per rank would give each rank a different advantage scale.
            adv = ops.masked_whiten(adv, m, reduce=dist.all_reduce_sum)
        first = adv[:, 0].tolist() if adv.shape[1] else [0.0] * len(ro)
        return Advantages(adv, returns, seq_kl, m, first)
    seq_score = scores.double() + (dense.sum(1).double() if dense is not None else 0.0)  # (B,)
    if kl_tok is not None and beta:
        seq_score = seq_score - beta * kl_tok.sum(1).double()  # TRL RLOO / OpenRLHF: KL in the reward
    parts = dist.all_gather_objects((ro.global_index, ro.group, seq_score.tolist()))  # every rank's samples
    index = torch.tensor([i for p in parts for i in p[0]])  # (N,)
    order = torch.argsort(index)  # global-index order: the same arrays on every rank, whatever the layout
    groups = torch.tensor([g for p in parts for g in p[1]])[order]  # (N,)
    all_scores = torch.tensor([x for p in parts for x in p[2]], dtype=torch.float64)[order]  # (N,)
    adv_all, zero_all, group_std = ops.group_advantages(all_scores, groups, ppo.estimator, ppo.group_scale,
                                                        ppo.group_std_floor)
    pos = torch.searchsorted(index[order], torch.tensor(ro.global_index, dtype=index.dtype))  # (B,) mine
    seq_adv, zero = adv_all[pos], zero_all[pos]  # (B,)
    adv = seq_adv.to(ro.logprobs.dtype).unsqueeze(1) * m  # (B, T): the outcome's advantage on every token
    loss_mask = m & ~zero.unsqueeze(1) if ppo.drop_zero_std_groups else m
    present = torch.unique(groups)
    n_zero = int(torch.unique(groups[zero_all]).numel())
    stats = {"reward/group_std": float(group_std[present].mean()),
             "reward/zero_std_groups": n_zero / max(1, int(present.numel())),
             "policy/advantage_abs": float(adv_all.abs().mean())}
    return Advantages(adv, None, seq_kl, loss_mask, seq_adv.tolist(), stats)


def _scaled_scores(ro: Rollouts, state: TrainState, ppo: PPOConfig) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scores (B,) and dense rewards (B, T) after ``ppo.reward_scaling`` and ``ppo.reward_clip``."""
    scores, dense = ro.scores.clone(), ro.dense_scores
    if ppo.reward_scaling == "running":
        # Running std over all ranks (trlx "running" scaling): scale without shifting the mean.
        state.reward_moments.update(ro.scores, reduce=dist.all_reduce_sum)
        scores = scores / max(state.reward_moments.std, 1e-8)
        dense = dense / max(state.reward_moments.std, 1e-8) if dense is not None else None
    if ppo.reward_clip is not None:
        scores = scores.clamp(-ppo.reward_clip, ppo.reward_clip)
    return scores, dense


# ------------------------------------------------------------------------------------------------
# Stage 5: PPO epochs

# Per-micro-batch statistics, summed in one device tensor (no host sync per micro-batch).
UPDATE_STATS = ("pg_loss", "vf_loss", "kl_loss", "loss", "clipfrac_tok", "vf_clipfrac_tok", "approx_kl_tok",
                "entropy_tok", "tokens")


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
    agg = dict(aggregation=ppo.loss_aggregation, max_len=batch.max_len)
    logits, values = model(take(ro.query_ids, slice(q0, Q)), take(ro.query_mask, slice(q0, Q)), resp, m)
    logits = logits.float() / temperature  # (b, T, V)
    lp = ops.logprobs_from_logits(logits, resp)  # (b, T)
    pg, pg_stats = ops.policy_loss(lp, take(ro.logprobs, t), take(adv.advantages, t), lm, ppo.clip_range, n_norm,
                                   clip_range_high=ppo.clip_range_high, **agg)
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
    return torch.stack([pg.detach().double(), vf.detach().double(), kl_loss.detach().double(),
                        loss.detach().double(), pg_stats["clipfrac"].double() * n, vf_clip.double() * n,
                        pg_stats["approx_kl"].double() * n, ops.masked_sum(ent.detach(), lm).double(), n])


# ------------------------------------------------------------------------------------------------
# The recipe


@releases_run_dir_lock  # the run-dir lock (main rank, RunDir.check_start) ends with this call, however it ends
def train(config: Config | dict | str | Path | None = None, reward_fn: Callable | Sequence[Callable] | None = None,
          prompts: Sequence[Any] | str | None = None, eval_prompts: Sequence[Any] | str | None = None,
          metric_fn: MetricFn | None = None, overrides: Sequence[str] | None = None,
          callbacks: Sequence[Any] | None = None) -> TrainResult:
    """Fine-tune ``model.path`` with PPO, GRPO or RLOO (``ppo.estimator``), like ``trlx.train``; every rank
    calls it. ``reward_fn``, ``prompts``, ``eval_prompts``, ``metric_fn`` override ``reward.fn``, ``data.*``,
    ``eval.metric_fn`` (trlx signature ``fn(samples, prompts, outputs, **kwargs)``); docs/data.md, docs/tracking.md."""
    cfg = load_config(config, list(overrides or []))
    inp = prepare_inputs(cfg, dist.expected_world_size(), reward_fn, metric_fn, prompts, eval_prompts)
    evals = set(eval_steps(cfg)) if len(inp.eval_set) else set()
    run_dir = RunDir.check_start(Path(cfg.train.run_dir), cfg, sorted(evals), lock=True)  # before anything heavy
    device = dist.init_accelerator(cfg.dist.timeout_s, cfg.model.sharding, cfg.train.mixed_precision)
    with _reward_host(cfg, inp) as reward_step:  # a `reward.server: local` starts now, stops however this ends
        models, learner, state = _build(cfg, inp, device)
        resumed_from, was_world_size = _resume(run_dir, cfg, models, learner, state)
        log = RunLog(run_dir.open(cfg, resumed_from, state.iteration, was_world_size), cfg, state.iteration,
                     TrainResult(run_dir.path), callbacks)
        log.start(plan := inp.plan, cfg, resumed_from, state.iteration, was_world_size)
        reward_step.notice = log.waiting  # "waiting for the reward on rank 0, 42 s" on the progress line
        run_eval = functools.partial(_evaluate, models, reward_step, inp, cfg, device, log)
        try:
            reward_step.open()  # `reward.server: local`: rank 0 waits for its server to answer (a collective)
            if resumed_from is None and 0 in evals:
                log.eval_before(run_eval(0))
            for step in range(state.iteration + 1, cfg.train.iterations + 1):
                t_iter = time.perf_counter()
                raise_if_interrupted()  # a Ctrl-C whose exception Python dropped (see errors.py) stops here
                # 1-2. rollouts (G completions of each drawn prompt) + the central reward step
                shard = _next_shard(plan, state, inp.train_set)  # every rank reads and checks the drawn prompts
                ro, rstats, times = collect_rollouts(models, reward_step, inp.train_set, shard, cfg.generation,
                                                     cfg.generation.do_sample, device,
                                                     cfg.rollout.logprobs_from == "generate")
                # 3-4. advantages of ppo.estimator (gae: KL-shaped rewards + GAE; grpo/rloo: group statistics)
                adv = compute_advantages(ro, state, cfg.ppo)
                # 5. PPO epochs (a non-finite loss or gradient norm is never applied)
                upd = ppo_update(learner, ro, adv, state, cfg.ppo, cfg.generation.temperature,
                                 cfg.generation.max_new_tokens, device)
                # 6. statistics (one all-reduce), KL controller, logs, eval
                metrics = _statistics(ro, adv, rstats, upd, times, inp, state, learner, models, step, cfg, run_dir)
                log.rollouts(ro, adv.seq_advantages, step, dist.rank())  # unless train.log_rollouts is off
                if step in evals:
                    metrics |= run_eval(step)
                state.iteration = step
                stop = log.iteration(step, metrics | {"time/iteration": time.perf_counter() - t_iter})  # callbacks
                # 7. checkpoint (collective, atomic); SIGTERM/SIGUSR1 on any rank: all stop here (checkpoint.on_signal)
                run_dir.checkpoint(step, models.policy, learner, state, cfg.checkpoint, stopping=stop)
                if stop:  # a callback's "stop", broadcast: every rank leaves after this iteration
                    break
            log.close()
            if cfg.train.save_final:
                run_dir.save_final(models.policy, models.tokenizer, log.result)
            dist.barrier()  # every rank leaves together (a peer still receiving the last broadcast must not see us go)
        except KeyboardInterrupt as stop:
            log.interrupted(state.iteration, run_dir.newest_checkpoint(), stop)
            raise
        finally:
            log.close()
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


def _next_shard(plan: BatchPlan, state: TrainState, prompts: PromptSet) -> Shard:
    """This rank's part of the next iteration: ``num_rollouts / G`` prompts drawn from the shared
    sampler (the same on every rank), each repeated G times in a row (group g = samples g*G..g*G+G-1).
    Every rank prepares (reads, renders, tokenizes, checks) all the drawn prompts, not only its own: a
    prompt that is too long or empty then raises the same error naming its row on every rank, at the
    same point, with no collective; and only this iteration's rows stay in memory."""
    drawn = state.sampler.next(plan.prompts_per_iteration)
    prompts.prepare(drawn)
    return Shard.of_plan(plan, dist.rank(), plan.sample_prompts(drawn))


def _evaluate(models: LoadedModels, reward_step: RewardStep, inp: Inputs, cfg: Config, device: torch.device,
              log: RunLog, step: int) -> dict[str, float]:
    return log.eval(step, *evaluate(models, reward_step, inp.eval_set, inp.metric_fn, cfg.generation,
                                    cfg.eval.do_sample, cfg.rollout.chunk_size, device, cfg.eval.samples_per_prompt))


def _statistics(ro: Rollouts, adv: Advantages, rstats: StepStats, upd: dict[str, float], times: dict[str, float],
                inp: Inputs, state: TrainState, learner: Learner, models: LoadedModels, step: int, cfg: Config,
                run_dir: RunDir) -> dict[str, float]:
    """The iteration's metrics (one all-reduce), the non-finite guard and the KL controller's update."""
    metrics = iteration_metrics(ro, adv, rstats, upd, [f.name for f in inp.reward_fns], state, inp.plan)
    metrics |= times | {"policy/lr": learner.lr, "time/update": upd["time"]}
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
        server = LocalRewardServer(r.fn or "", r.kwargs, r.server_args,
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
