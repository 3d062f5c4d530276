"""The PPO loop, as named stages.

    collect rollouts -> central reward step -> shape rewards (KL penalty) -> GAE -> PPO epochs
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
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import checkpoint as ckpt
from . import dist, ops
from .config import BatchPlan, Config, GenerationConfig, PPOConfig, load_config, split_evenly
from .data import PromptSampler
from .errors import MetricError, NonFiniteError
from .inputs import Inputs, MetricFn, prepare_inputs
from .models import LoadedModels, load_models
from .reward.step import RewardStep, Samples, StepStats, call_kwargs
from .rollout import Rollouts, generate, score_tokens
from .seeding import isolated_rng, seed_everything, stream_seed
from .state import Learner, TrainState
from .tracking import RunDir, RunWriter


@dataclass
class TrainResult:
    run_dir: Path
    metrics: list[dict[str, float]] = field(default_factory=list)  # one dict per iteration (main rank)
    eval_before: dict[str, float] = field(default_factory=dict)  # eval/* before the first iteration
    eval_after: dict[str, float] = field(default_factory=dict)  # eval/* of the latest evaluation


@dataclass(frozen=True)
class Shard:
    """This rank's part of a batch: its global sample indices (rank-major order), the global index of
    its first sample, and the chunk rounds EVERY rank runs (so each enters the reward step as often)."""

    indices: list[int]
    first_index: int
    rounds: int
    chunk_size: int

    @staticmethod
    def of_plan(plan: BatchPlan, rank: int, global_indices: list[int]) -> "Shard":
        off = plan.offset(rank)
        return Shard(global_indices[off : off + plan.local_count(rank)], off, plan.rounds, plan.chunk_size)

    @staticmethod
    def even(n: int, world_size: int, rank: int, chunk_size: int) -> "Shard":
        """``n`` samples (e.g. the eval set) split as evenly as possible."""
        counts = split_evenly(n, world_size)
        off = sum(counts[:rank])
        return Shard(list(range(off, off + counts[rank])), off, -(-max(counts) // chunk_size), chunk_size)


# ------------------------------------------------------------------------------------------------
# Stage 1+2: collect rollouts, with the central reward step once per chunk round


def collect_rollouts(models: LoadedModels, reward_step: RewardStep, records: list[dict[str, Any]],
                     query_ids: list[list[int]], shard: Shard, gen: GenerationConfig, do_sample: bool,
                     device: torch.device) -> tuple[Rollouts, StepStats, dict[str, float]]:
    chunks: list[Rollouts] = []
    total = StepStats()
    t_gen = t_fwd = 0.0
    for r in range(shard.rounds):
        mine = shard.indices[r * shard.chunk_size : (r + 1) * shard.chunk_size]  # may be empty on some ranks
        prompts = [records[i]["prompt"] for i in mine]
        metadata = [{k: v for k, v in records[i].items() if k != "prompt"} for i in mine]
        t0 = time.perf_counter()
        g = generate(models.policy, models.tokenizer, [query_ids[i] for i in mine], gen, do_sample, device)
        t_gen += time.perf_counter() - t0
        rewards, st = reward_step(Samples(prompts, g.outputs, g.response_lists, metadata))  # a collective
        total.add(st)
        if mine:
            t0 = time.perf_counter()
            scored = score_tokens(models.policy, models.reference, g, gen.temperature, device)
            t_fwd += time.perf_counter() - t0
            first = shard.first_index + r * shard.chunk_size
            chunks.append(Rollouts.from_chunk(g, scored, rewards, prompts, metadata,
                                              list(range(first, first + len(mine)))))
    ro = Rollouts.concat(chunks, models.tokenizer.pad_token_id)
    return ro, total, {"time/generate": t_gen, "time/forward": t_fwd}


# ------------------------------------------------------------------------------------------------
# Stage 3+4: reward shaping and advantages


def shape_rewards(ro: Rollouts, state: TrainState, ppo: PPOConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards (B, T) = score on the last token + dense scores - beta * KL; and per-sample KL."""
    scores, dense = ro.scores.clone(), ro.dense_scores
    if ppo.reward_scaling == "running":
        # Running std over all ranks (trlx "running" scaling): scale without shifting the mean.
        state.reward_moments.update(ro.scores, reduce=dist.all_reduce_sum)
        scores = scores / max(state.reward_moments.std, 1e-8)
        dense = dense / max(state.reward_moments.std, 1e-8) if dense is not None else None
    if ppo.reward_clip is not None:
        scores = scores.clamp(-ppo.reward_clip, ppo.reward_clip)
    kl_tok = ops.kl_estimate(ro.logprobs, ro.ref_logprobs, ppo.kl_estimator) * ro.response_mask  # (B, T)
    rewards = ops.penalized_rewards(kl_tok, ro.response_mask, state.kl_ctl.value, scores, dense)  # (B, T)
    seq_kl = (ro.logprobs - ro.ref_logprobs).mul(ro.response_mask).sum(1)  # (B,) k1 per sequence
    return rewards, seq_kl


def compute_advantages(ro: Rollouts, rewards: torch.Tensor, ppo: PPOConfig) -> tuple[torch.Tensor, torch.Tensor]:
    adv, returns = ops.gae(rewards, ro.values, ro.response_mask, ppo.gamma, ppo.lam)  # (B, T)
    if ppo.whiten_advantages:
        # Global statistics: whitening per rank would give each rank a different advantage scale.
        adv = ops.masked_whiten(adv, ro.response_mask, reduce=dist.all_reduce_sum)
    return adv, returns


# ------------------------------------------------------------------------------------------------
# Stage 5: PPO epochs

# Per-micro-batch statistics, summed in one device tensor (no host sync per micro-batch).
UPDATE_STATS = ("pg_loss", "vf_loss", "loss", "clipfrac_tok", "vf_clipfrac_tok", "approx_kl_tok", "entropy_tok",
                "tokens")


def ppo_update(learner: Learner, ro: Rollouts, advantages: torch.Tensor, returns: torch.Tensor,
               state: TrainState, ppo: PPOConfig, temperature: float, device: torch.device) -> dict[str, float]:
    """``ppo.epochs`` passes over the batch in ``ppo.num_minibatches`` optimizer steps. Returns the sums
    of ``UPDATE_STATS`` plus ``grad_norm`` (summed over applied steps), ``steps`` and ``skipped``."""
    B, M, W = len(ro), ppo.num_minibatches, dist.world_size()
    # Lengths on the host once per update: micro-batches trim all-padding columns with plain ints.
    resp_len, query_len = ro.response_mask.sum(1).tolist(), ro.query_mask.sum(1).tolist()
    sums = torch.zeros(len(UPDATE_STATS), dtype=torch.float64, device=device)
    norm_sum, steps, skipped = 0.0, 0, 0
    for _ in range(ppo.epochs):
        perm = torch.randperm(B, generator=state.shuffle_gen)
        minibatches = [mb.tolist() for mb in torch.tensor_split(perm, M)]
        # The loss is a token mean over the GLOBAL minibatch: one all-reduce of all M token counts per
        # epoch. DDP averages gradients over W ranks, so each rank divides its token sum by N/W.
        local_counts = torch.tensor([float(sum(resp_len[i] for i in mb)) for mb in minibatches], dtype=torch.float64)
        global_counts = dist.all_reduce_sum(local_counts)
        for j, mb in enumerate(minibatches):
            learner.optimizer.zero_grad(set_to_none=True)
            # Gradient accumulation over micro-batches: every piece is normalised by the same global
            # token count, so the summed gradient equals the whole minibatch's. Only the last backward
            # synchronises (ranks may take different numbers of micro-batches).
            micro = [mb[a : a + (ppo.micro_batch_size or len(mb))] for a in range(0, len(mb), ppo.micro_batch_size or len(mb))]
            step_loss = torch.zeros((), dtype=torch.float64, device=device)
            for k, rows in enumerate(micro):
                sync = contextlib.nullcontext() if k == len(micro) - 1 else dist.no_sync(learner.model)
                with sync:
                    part = _micro_step(learner.model, ro, rows, resp_len, query_len, advantages, returns,
                                       global_counts[j] / W, ppo, temperature, device)
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
    out.update(grad_norm=norm_sum, steps=float(steps), skipped=float(skipped))
    return out


def _micro_step(model: torch.nn.Module, ro: Rollouts, rows: list[int], resp_len: list[int], query_len: list[int],
                advantages: torch.Tensor, returns: torch.Tensor, n_norm: torch.Tensor, ppo: PPOConfig,
                temperature: float, device: torch.device) -> torch.Tensor:
    """Forward + backward of the PPO loss on ``rows``; returns its ``UPDATE_STATS`` as a device tensor."""
    # Trim columns that are padding for every row of this micro-batch (pure speed; same math).
    T, Q = max(resp_len[i] for i in rows), ro.query_ids.shape[1]
    q0 = Q - max(query_len[i] for i in rows)
    idx = torch.tensor(rows)

    def take(x: torch.Tensor, cols: slice) -> torch.Tensor:
        return x[idx, cols].to(device)

    resp, m = take(ro.response_ids, slice(0, T)), take(ro.response_mask, slice(0, T))  # (b, T)
    logits, values = model(take(ro.query_ids, slice(q0, Q)), take(ro.query_mask, slice(q0, Q)), resp, m)
    logits = logits.float() / temperature  # (b, T, V)
    lp = ops.logprobs_from_logits(logits, resp)  # (b, T)
    pg, pg_stats = ops.policy_loss(lp, take(ro.logprobs, slice(0, T)), take(advantages, slice(0, T)), m,
                                   ppo.clip_range, n_norm)
    vf, vf_stats = ops.value_loss(values.float(), take(ro.values, slice(0, T)), take(returns, slice(0, T)), m,
                                  ppo.clip_range_value, n_norm)
    loss = pg + ppo.vf_coef * vf
    if ppo.entropy_coef > 0:
        ent = ops.entropy_from_logits(logits)
        loss = loss - ppo.entropy_coef * ops.masked_sum(ent, m) / n_norm
    else:
        with torch.no_grad():
            ent = ops.entropy_from_logits(logits)
    dist.backward(loss)
    n = m.sum().double()
    return torch.stack([pg.detach().double(), vf.detach().double(), loss.detach().double(),
                        pg_stats["clipfrac"].double() * n, vf_stats["clipfrac"].double() * n,
                        pg_stats["approx_kl"].double() * n, ops.masked_sum(ent.detach(), m).double(), n])


# ------------------------------------------------------------------------------------------------
# Evaluation: same generation and reward step, plus metric_fn on the main rank


def evaluate(models: LoadedModels, reward_step: RewardStep, records: list[dict[str, Any]],
             query_ids: list[list[int]], metric_fn: MetricFn | None, gen: GenerationConfig, do_sample: bool,
             chunk_size: int, device: torch.device) -> tuple[dict[str, float], list[dict[str, Any]]]:
    shard = Shard.even(len(records), dist.world_size(), dist.rank(), chunk_size)
    t0 = time.perf_counter()
    # Evaluation must not move the training sampling stream (same guarantee as the reward step). It
    # needs only samples and rewards: no policy/reference scoring pass.
    with isolated_rng():
        samples = _eval_samples(models, reward_step, records, query_ids, shard, gen, do_sample, device)

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


def _eval_samples(models: LoadedModels, reward_step: RewardStep, records: list[dict[str, Any]],
                  query_ids: list[list[int]], shard: Shard, gen: GenerationConfig, do_sample: bool,
                  device: torch.device) -> list[dict[str, Any]]:
    """Every eval sample with its reward, gathered on the main rank ([] elsewhere)."""
    local: list[dict[str, Any]] = []
    for r in range(shard.rounds):
        mine = shard.indices[r * shard.chunk_size : (r + 1) * shard.chunk_size]
        g = generate(models.policy, models.tokenizer, [query_ids[i] for i in mine], gen, do_sample, device)
        metadata = [{k: v for k, v in records[i].items() if k != "prompt"} for i in mine]
        prompts = [records[i]["prompt"] for i in mine]
        rewards, _ = reward_step(Samples(prompts, g.outputs, g.response_lists, metadata))
        local += [{"index": i, "prompt": p, "output": o, "reward": rw.total, "output_token_ids": t, "metadata": md}
                  for i, p, o, rw, t, md in zip(mine, prompts, g.outputs, rewards, g.response_lists, metadata)]
    gathered = dist.gather_objects(local, dst=0)
    return [s for part in gathered or [] for s in part]


# ------------------------------------------------------------------------------------------------
# The recipe


def train(
    config: Config | dict | str | Path | None = None,
    reward_fn: Callable | Sequence[Callable] | None = None,
    prompts: Sequence[Any] | str | None = None,
    eval_prompts: Sequence[Any] | str | None = None,
    metric_fn: MetricFn | None = None,
    overrides: Sequence[str] | None = None,
) -> TrainResult:
    """Fine-tune ``model.path`` with PPO. Shaped like ``trlx.train``; every rank calls it.

    ``config``: a Config, a dict or a YAML path. ``reward_fn``: a callable (or list of callables)
    ``reward_fn(samples, prompts, outputs, **kwargs)``; default: ``reward.fn`` from the config.
    ``prompts``/``eval_prompts``: override ``data.prompts``/``data.eval_prompts``. ``metric_fn``: same
    signature, returns ``{name: per-sample values}`` logged as ``eval/<name>``.
    """
    cfg = load_config(config, list(overrides or []))
    inp = prepare_inputs(cfg, dist.expected_world_size(), reward_fn, metric_fn, prompts, eval_prompts)
    run_dir = RunDir(Path(cfg.train.run_dir))
    run_dir.check_start(cfg.train, eval_steps(cfg) if inp.eval_records else [])  # before anything heavy
    device = dist.init_accelerator(cfg.dist.timeout_s)
    models, learner, state = _build(cfg, inp, device)
    reward_step = RewardStep(inp.reward_fns, cfg.reward.placement, cfg.reward.batch_size, inp.tokenizer)
    resumed_from = _resume(run_dir, cfg, models, learner, state)
    writer, plan, R = run_dir.open(cfg, resumed_from), inp.plan, dist.rank()
    log = _Log(writer, cfg, state.iteration, TrainResult(run_dir=run_dir.path))
    log.say(f"rallyrl: {plan.world_size} process(es), {plan.num_rollouts} rollouts/iteration "
            f"({'/'.join(map(str, plan.local_counts))} per rank, {plan.rounds} chunk round(s)), "
            f"{cfg.train.iterations} iterations, reward placement '{cfg.reward.placement}'")

    def run_eval(step: int) -> dict[str, float]:
        metrics, samples = evaluate(models, reward_step, inp.eval_records, inp.eval_query_ids, inp.metric_fn,
                                    cfg.generation, cfg.eval.do_sample, cfg.rollout.chunk_size, device)
        return log.eval(step, metrics, samples)

    try:
        if resumed_from is None and inp.eval_records:
            log.eval_before(run_eval(0))
        elif resumed_from is not None:
            log.say(f"resumed from {resumed_from} at iteration {state.iteration}")
        for step in range(state.iteration + 1, cfg.train.iterations + 1):
            t_iter = time.perf_counter()
            # 1-2. rollouts + central reward step
            shard = Shard.of_plan(plan, R, state.sampler.next(plan.num_rollouts))
            ro, rstats, times = collect_rollouts(models, reward_step, inp.records, inp.query_ids, shard,
                                                 cfg.generation, cfg.generation.do_sample, device)
            times["time/rollout"] = time.perf_counter() - t_iter
            # 3-4. KL-shaped rewards and advantages
            rewards, seq_kl = shape_rewards(ro, state, cfg.ppo)
            advantages, returns = compute_advantages(ro, rewards, cfg.ppo)
            # 5. PPO epochs (a non-finite loss or gradient norm is never applied)
            t0 = time.perf_counter()
            upd = ppo_update(learner, ro, advantages, returns, state, cfg.ppo, cfg.generation.temperature, device)
            times["time/update"] = time.perf_counter() - t0
            # 6. statistics (one all-reduce), KL controller, logs, eval
            metrics = iteration_metrics(ro, seq_kl, returns, rstats, upd, [f.name for f in inp.reward_fns],
                                        state, plan) | times | {"policy/lr": learner.lr}
            _check_finite(metrics, upd, step, cfg.ppo, run_dir)
            state.kl_ctl.update(metrics["policy/kl"], plan.num_rollouts)
            if cfg.train.log_rollouts:
                log.rollouts(ro, step, R)
            if inp.eval_records and ((cfg.eval.interval and step % cfg.eval.interval == 0)
                                     or step == cfg.train.iterations):
                metrics |= run_eval(step)
            state.iteration = step
            log.iteration(step, metrics | {"time/iteration": time.perf_counter() - t_iter})
            # 7. checkpoint (collective; atomic; a failure on any rank stops every rank)
            if cfg.checkpoint.interval and step % cfg.checkpoint.interval == 0:
                run_dir.save_checkpoint(step, models.policy, learner, state, cfg.checkpoint.keep_last)
        log.close()
        if cfg.train.save_final:
            run_dir.save_final(models.policy, models.tokenizer)
        # Every rank leaves together: a process that exits while a peer is still receiving from it (the
        # broadcast of the last agreed stage) tears down gloo under that peer and aborts.
        dist.barrier()
    finally:
        log.close()
    return log.result


# ------------------------------------------------------------------------------------------------
# helpers of the recipe


def eval_steps(cfg: Config) -> list[int]:
    """The steps at which a run evaluates (0 = before the first iteration)."""
    n, k = cfg.train.iterations, cfg.eval.interval
    return sorted({0, n} | ({s for s in range(k, n + 1, k)} if k else set()))


def _build(cfg: Config, inp: Inputs, device: torch.device) -> tuple[LoadedModels, Learner, TrainState]:
    """Models, optimizer + schedule and the fresh train state, seeded (see ``rallyrl.seeding``)."""
    W, R = dist.world_size(), dist.rank()
    assert inp.plan.world_size == W, f"inputs were checked for {inp.plan.world_size} processes, the group has {W}"
    torch.set_num_threads(cfg.train.num_threads or max(1, (os.cpu_count() or 1) // dist.local_world_size()))
    torch.manual_seed(cfg.train.seed)  # shared: any random init inside from_pretrained matches on all ranks
    models = _quiet(load_models, cfg.model, cfg.train.seed, inp.tokenizer)
    models.policy.to(device)
    models.reference.to(device)
    seed_everything(cfg.train.seed, R)  # per-rank: generation sampling
    total_steps = cfg.train.iterations * inp.plan.optimizer_steps_per_iteration
    learner = Learner.create(models.policy, cfg.ppo, total_steps)
    state = TrainState.fresh(cfg, len(inp.records), shuffle_seed=stream_seed(cfg.train.seed, "minibatch", R))
    return models, learner, state


def _resume(run_dir: RunDir, cfg: Config, models: LoadedModels, learner: Learner, state: TrainState) -> Path | None:
    """Restore the run from the checkpoint the main rank picks (so every rank loads the same one)."""
    path = run_dir.resume_point(cfg.train)
    if path is None:
        return None
    saved = ckpt.load_checkpoint(path, models.policy, learner.optimizer, state.shuffle_gen)
    state.load_state_dict(saved)
    learner.load_state_dict(saved["scheduler"])
    run_dir.truncate_logs(state.iteration)
    return path


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


def iteration_metrics(ro: Rollouts, seq_kl: torch.Tensor, returns: torch.Tensor, rstats: StepStats,
                      upd: dict[str, float], names: list[str], state: TrainState, plan: BatchPlan) -> dict[str, float]:
    """Global statistics of the iteration, with ONE all-reduce (sums; means derived afterwards)."""
    total = ro.total_rewards()  # (B,)
    m = ro.response_mask
    resid = (returns - ro.values) * m
    local = {
        "n": float(len(ro)), "reward_sum": float(total.sum()), "reward_sq": float((total**2).sum()),
        "kl_sum": float(seq_kl.sum()), "len_sum": float(m.sum()),
        "value_sum": float((ro.values * m).sum()),
        "ret_sum": float(returns.mul(m).sum()), "ret_sq": float(returns.double().pow(2).mul(m).sum()),
        "res_sum": float(resid.sum()), "res_sq": float(resid.double().pow(2).sum()),
        "calls": float(rstats.calls), "samples": float(rstats.samples), "time_reward": rstats.time_reward,
        **{f"u_{k}": v for k, v in upd.items()},
        **{f"c_{n}": float(sum(c.get(n, 0.0) for c in ro.reward_components)) for n in names},
    }
    g = dist.reduce_stats(local)
    W = plan.world_size
    n, tok = g["n"], max(1.0, g["len_sum"])
    mean = g["reward_sum"] / n
    var_ret = g["ret_sq"] / tok - (g["ret_sum"] / tok) ** 2
    var_res = g["res_sq"] / tok - (g["res_sum"] / tok) ** 2
    steps = max(1.0, g["u_steps"] / W)  # applied optimizer steps (identical on every rank)
    all_steps = max(1.0, (g["u_steps"] + g["u_skipped"]) / W)
    utok = max(1.0, g["u_tokens"])
    out = {
        "reward/mean": mean,
        "reward/std": math.sqrt(max(0.0, g["reward_sq"] / n - mean**2) * n / max(1.0, n - 1)),
        "reward/calls": g["calls"],
        "reward/samples_per_call": g["samples"] / max(1.0, g["calls"]),
        "time/reward": g["time_reward"],
        "time/reward_gather": rstats.time_gather,  # this (main) rank's time moving samples and rewards
        "policy/kl": g["kl_sum"] / n,
        "policy/kl_coef": state.kl_ctl.value,
        "policy/response_length": g["len_sum"] / n,
        "policy/loss": g["u_pg_loss"] / W / all_steps,
        "policy/clipfrac": g["u_clipfrac_tok"] / utok,
        "policy/approx_kl": g["u_approx_kl_tok"] / utok,
        "policy/entropy": g["u_entropy_tok"] / utok,
        "policy/total_loss": g["u_loss"] / W / all_steps,
        "policy/grad_norm": g["u_grad_norm"] / W / steps,
        "policy/optimizer_steps": float(state.optimizer_steps),
        "policy/nonfinite_skips": float(state.nonfinite_skips),
        "value/loss": g["u_vf_loss"] / W / all_steps,
        "value/clipfrac": g["u_vf_clipfrac_tok"] / utok,
        "value/mean": g["value_sum"] / tok,
        "value/explained_variance": 1.0 - var_res / var_ret if var_ret > 1e-12 else 0.0,
    }
    if len(names) > 1:
        out.update({f"reward/{k}": g[f"c_{k}"] / n for k in names})
    return out


class _Log:
    """Progress bar, the per-iteration line and the run-dir writers (main rank; no-ops elsewhere)."""

    def __init__(self, writer: RunWriter | None, cfg: Config, start: int, result: TrainResult) -> None:
        self.writer, self.total, self.result = writer, cfg.train.iterations, result
        self.bar = None
        if cfg.train.progress and dist.is_main():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=self.total, initial=start, desc="ppo", unit="it", file=sys.stderr,
                            dynamic_ncols=True, leave=False)

    def say(self, msg: str) -> None:
        if not dist.is_main():
            return
        if self.bar is not None:
            self.bar.write(msg, file=sys.stderr)
        else:
            print(msg, file=sys.stderr, flush=True)

    def eval(self, step: int, metrics: dict[str, float], samples: list[dict[str, Any]]) -> dict[str, float]:
        if self.writer:
            self.writer.log_eval_samples(step, samples)
        self.say("eval @ %d: %s" % (step, ", ".join(f"{k}={v:.4f}" for k, v in metrics.items() if k.startswith("eval/"))))
        if step > 0:
            self.result.eval_after = {k: v for k, v in metrics.items() if k.startswith("eval/")}
        return metrics

    def eval_before(self, metrics: dict[str, float]) -> None:
        """The evaluation of the initial policy: a ``step: 0`` row, so every eval curve starts there."""
        self.result.eval_before = {k: v for k, v in metrics.items() if k.startswith("eval/")}
        if self.writer:
            self.writer.log_metrics(0, metrics)

    def rollouts(self, ro: Rollouts, step: int, rank: int) -> None:
        totals = ro.total_rewards().tolist()
        kls = (ro.logprobs - ro.ref_logprobs).mul(ro.response_mask).sum(1).tolist()
        recs = [{"step": step, "rank": rank, "index": i, "prompt": p, "output": o, "reward": totals[k], "kl": kls[k]}
                for k, (i, p, o) in enumerate(zip(ro.global_index, ro.prompts, ro.outputs))]
        gathered = dist.gather_objects(recs, dst=0)
        if self.writer and gathered:
            self.writer.log_rollouts([r for part in gathered for r in part])

    def iteration(self, step: int, m: dict[str, float]) -> None:
        if self.writer:
            self.writer.log_metrics(step, m)
            self.result.metrics.append(m)
        if not dist.is_main():
            return
        line = (f"iter {step}/{self.total} | reward {m['reward/mean']:.4f} | kl {m['policy/kl']:.4f} | "
                f"loss {m['policy/total_loss']:.4f} | clipfrac {m['policy/clipfrac']:.3f} | {m['time/iteration']:.2f}s")
        extra = [f"{k}={v:.4f}" for k, v in m.items() if k.startswith("eval/")]
        if extra:
            line += " | " + " ".join(extra)
        if self.bar is not None:
            self.bar.update(1)
        self.say(line)

    def close(self) -> None:
        # The bar is closed before anything else is printed, so an error line stands on its own.
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.writer:
            self.writer.close()
            self.writer = None


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
