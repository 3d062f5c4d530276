"""The PPO loop, as named stages.

    collect rollouts -> central reward step -> shape rewards (KL penalty) -> GAE -> PPO epochs
    -> log / eval / checkpoint

``train()`` reads top to bottom like a recipe; each stage is a function with typed inputs and outputs.
Single- and multi-process runs execute the same code (every collective in ``dist`` is a no-op at world
size 1). Statistics that define the update (advantage whitening, reward scaling, the loss normaliser)
are global over all ranks, so N processes compute what one process would on the same samples.
"""

from __future__ import annotations

import contextlib
import json
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
from .config import BatchPlan, Config, ConfigError, load_config, make_batch_plan, reward_fn_name, split_evenly
from .data import PromptSampler, load_prompts
from .inputs import prepare_inputs
from .models import LoadedModels, load_models
from .reward.step import NamedRewardFn, Reward, RewardError, RewardStep, Samples, StepStats, _failure, call_kwargs
from .rollout import Rollouts, generate, left_pad, right_pad, score_tokens
from .seeding import isolated_rng, rank_seed, seed_everything
from .tracking import RunWriter

MetricFn = Callable[..., dict[str, Sequence[float]]]


# ------------------------------------------------------------------------------------------------
# State that a checkpoint must hold to resume the same run (see checkpoint.py)


@dataclass
class TrainState:
    iteration: int  # iterations completed
    kl_ctl: ops.FixedKLController | ops.AdaptiveKLController
    reward_moments: ops.RunningMoments
    sampler: PromptSampler
    shuffle_gen: torch.Generator  # per-rank minibatch order
    optimizer_steps: int = 0


@dataclass
class TrainResult:
    run_dir: Path
    metrics: list[dict[str, float]] = field(default_factory=list)  # one dict per iteration (main rank)
    eval_before: dict[str, float] = field(default_factory=dict)  # eval/* before the first iteration
    eval_after: dict[str, float] = field(default_factory=dict)  # eval/* of the latest evaluation


# ------------------------------------------------------------------------------------------------
# Inputs: resolved and checked before any model is loaded


# ------------------------------------------------------------------------------------------------
# Stage 1+2: collect rollouts, with the central reward step once per chunk round


def collect_rollouts(
    models: LoadedModels,
    reward_step: RewardStep,
    records: list[dict[str, Any]],
    query_ids: list[list[int]],
    indices: list[int],  # this rank's prompt indices, in global order
    global_offset: int,
    plan_rounds: int,
    chunk_size: int,
    cfg: Config,
    device: torch.device,
    do_sample: bool,
) -> tuple[Rollouts, StepStats, dict[str, float]]:
    pieces: list[dict[str, Any]] = []
    total = StepStats()
    t_gen = t_fwd = 0.0
    tok = models.tokenizer
    for r in range(plan_rounds):
        mine = indices[r * chunk_size : (r + 1) * chunk_size]  # may be empty on some ranks
        t0 = time.perf_counter()
        g = generate(models.policy.lm, tok, [query_ids[i] for i in mine], cfg.generation, do_sample, device)
        t_gen += time.perf_counter() - t0
        samples = Samples(
            prompts=[records[i]["prompt"] for i in mine],
            outputs=g.outputs,
            output_token_ids=g.response_ids,
            metadata=[{k: v for k, v in records[i].items() if k != "prompt"} for i in mine],
        )
        rewards, st = reward_step(samples)  # a collective: every rank enters it every round
        total.calls += st.calls
        total.samples += st.samples
        total.time_reward += st.time_reward
        total.time_gather += st.time_gather
        if mine:
            t0 = time.perf_counter()
            scored = score_tokens(models.policy, models.ref, g.query_ids, g.response_ids, tok.pad_token_id,
                                  cfg.generation.temperature, device)
            t_fwd += time.perf_counter() - t0
            pieces.append({"gen": g, "samples": samples, "rewards": rewards, "scored": scored,
                           "index": list(range(global_offset + r * chunk_size,
                                               global_offset + r * chunk_size + len(mine)))})
    return _merge(pieces, tok.pad_token_id), total, {"time/generate": t_gen, "time/forward": t_fwd}


def _merge(pieces: list[dict[str, Any]], pad_id: int) -> Rollouts:
    """Concatenate per-chunk results (re-padding queries on the left, responses on the right)."""
    q_ids = [q for p in pieces for q in p["gen"].query_ids]
    r_ids = [r for p in pieces for r in p["gen"].response_ids]
    q, qm = left_pad(q_ids, pad_id)
    r, rm = right_pad(r_ids, pad_id)
    T = r.shape[1]

    def cat_right(key: str) -> torch.Tensor:
        rows = [torch.nn.functional.pad(p["scored"][key], (0, T - p["scored"][key].shape[1])) for p in pieces]
        return torch.cat(rows) if rows else torch.zeros(0, T)

    rewards: list[Reward] = [rw for p in pieces for rw in p["rewards"]]
    scores = torch.tensor([rw.score for rw in rewards], dtype=torch.float32)
    dense = None
    if any(rw.dense is not None for rw in rewards):
        dense = torch.zeros(len(rewards), T)
        for i, rw in enumerate(rewards):
            if rw.dense is not None:
                dense[i, : len(rw.dense)] = torch.tensor(rw.dense)
    return Rollouts(
        query_ids=q, query_mask=qm, response_ids=r, response_mask=rm,
        logprobs=cat_right("logprobs"), ref_logprobs=cat_right("ref_logprobs"), values=cat_right("values"),
        scores=scores, dense_scores=dense,
        prompts=[s for p in pieces for s in p["samples"].prompts],
        outputs=[s for p in pieces for s in p["samples"].outputs],
        metadata=[m for p in pieces for m in p["samples"].metadata],
        global_index=[i for p in pieces for i in p["index"]],
        reward_components=[rw.components for rw in rewards],
    )


# ------------------------------------------------------------------------------------------------
# Stage 3+4: reward shaping and advantages


def shape_rewards(ro: Rollouts, state: TrainState, cfg: Config) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards (B, T) = score on the last token + dense scores - beta * KL; and per-sample KL."""
    scores, dense = ro.scores.clone(), ro.dense_scores
    if cfg.ppo.reward_scaling == "running":
        # Running std over all ranks (trlx "running" scaling): scale without shifting the mean.
        state.reward_moments.update(ro.scores, reduce=dist.all_reduce_sum)
        scores = scores / max(state.reward_moments.std, 1e-8)
        dense = dense / max(state.reward_moments.std, 1e-8) if dense is not None else None
    if cfg.ppo.reward_clip is not None:
        scores = scores.clamp(-cfg.ppo.reward_clip, cfg.ppo.reward_clip)
    kl_tok = ops.kl_estimate(ro.logprobs, ro.ref_logprobs, cfg.ppo.kl_estimator) * ro.response_mask  # (B, T)
    rewards = ops.penalized_rewards(kl_tok, ro.response_mask, state.kl_ctl.value, scores, dense)  # (B, T)
    seq_kl = (ro.logprobs - ro.ref_logprobs).mul(ro.response_mask).sum(1)  # (B,) k1 per sequence
    return rewards, seq_kl


def compute_advantages(ro: Rollouts, rewards: torch.Tensor, cfg: Config) -> tuple[torch.Tensor, torch.Tensor]:
    adv, returns = ops.gae(rewards, ro.values, ro.response_mask, cfg.ppo.gamma, cfg.ppo.lam)  # (B, T)
    if cfg.ppo.whiten_advantages:
        # Global statistics: whitening per rank would give each rank a different advantage scale.
        adv = ops.masked_whiten(adv, ro.response_mask, reduce=dist.all_reduce_sum)
    return adv, returns


# ------------------------------------------------------------------------------------------------
# Stage 5: PPO epochs


def ppo_update(
    model: torch.nn.Module,  # the (possibly DDP-wrapped) PolicyWithValueHead
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    ro: Rollouts,
    advantages: torch.Tensor,
    returns: torch.Tensor,
    state: TrainState,
    cfg: Config,
    device: torch.device,
) -> dict[str, float]:
    B, M, W = len(ro), cfg.ppo.num_minibatches, dist.world_size()
    sums: dict[str, float] = {"pg_loss": 0.0, "vf_loss": 0.0, "loss": 0.0, "grad_norm": 0.0,
                              "clipfrac_tok": 0.0, "vf_clipfrac_tok": 0.0, "approx_kl_tok": 0.0,
                              "entropy_tok": 0.0, "tokens": 0.0, "steps": 0.0}
    # With clipping off, an infinite max norm still returns the (pre-clip) norm for the logs.
    max_norm = cfg.ppo.max_grad_norm if cfg.ppo.max_grad_norm is not None else float("inf")
    for _ in range(cfg.ppo.epochs):
        perm = torch.randperm(B, generator=state.shuffle_gen)
        minibatches = torch.tensor_split(perm, M)
        # The loss is a token mean over the GLOBAL minibatch: one all-reduce of all M token counts per
        # epoch. DDP averages gradients over W ranks, so each rank divides its token sum by N/W.
        local_counts = torch.stack([ro.response_mask[mb].sum() for mb in minibatches]).double()
        global_counts = dist.all_reduce_sum(local_counts)
        for j, mb in enumerate(minibatches):
            optimizer.zero_grad(set_to_none=True)
            # Gradient accumulation over micro-batches: every piece is normalised by the same global
            # token count, so the summed gradient equals the whole minibatch's. Only the last backward
            # synchronises (ranks may take different numbers of micro-batches).
            micro = torch.split(mb, cfg.ppo.micro_batch_size or len(mb))
            for k, part in enumerate(micro):
                sync = contextlib.nullcontext() if k == len(micro) - 1 else dist.no_sync(model)
                with sync:
                    _micro_step(model, ro, part, advantages, returns, global_counts[j] / W, cfg, device, sums)
            sums["grad_norm"] += dist.clip_grad_norm(model, max_norm)
            optimizer.step()
            scheduler.step()
            state.optimizer_steps += 1
            sums["steps"] += 1
    return sums


def _micro_step(model: torch.nn.Module, ro: Rollouts, rows: torch.Tensor,
                advantages: torch.Tensor, returns: torch.Tensor, n_norm: torch.Tensor, cfg: Config,
                device: torch.device, sums: dict[str, float]) -> None:
    """Forward + backward of the PPO loss on ``rows`` of the batch; adds its statistics to ``sums``."""
    Q = ro.query_ids.shape[1]
    rmask = ro.response_mask[rows]
    # Trim columns that are padding for every row of this micro-batch (pure speed; same math).
    T_mb = int(rmask.sum(1).max())
    q_start = int((~ro.query_mask[rows]).all(0).long().cumprod(0).sum())
    ids = torch.cat([ro.query_ids[rows], ro.response_ids[rows]], 1)[:, q_start : Q + T_mb].to(device)
    mask = torch.cat([ro.query_mask[rows], rmask], 1)[:, q_start : Q + T_mb].to(device)
    m = rmask[:, :T_mb].to(device)
    logits, values = model(ids, mask, T_mb)  # (b, T_mb, V), (b, T_mb)
    logits = logits.float() / cfg.generation.temperature
    lp = ops.logprobs_from_logits(logits, ro.response_ids[rows][:, :T_mb].to(device))  # (b, T_mb)
    pg, pg_stats = ops.policy_loss(lp, ro.logprobs[rows][:, :T_mb].to(device),
                                   advantages[rows][:, :T_mb].to(device), m, cfg.ppo.clip_range, n_norm)
    vf, vf_stats = ops.value_loss(values.float(), ro.values[rows][:, :T_mb].to(device),
                                  returns[rows][:, :T_mb].to(device), m, cfg.ppo.clip_range_value, n_norm)
    loss = pg + cfg.ppo.vf_coef * vf
    if cfg.ppo.entropy_coef > 0:
        ent = ops.entropy_from_logits(logits)
        loss = loss - cfg.ppo.entropy_coef * ops.masked_sum(ent, m) / n_norm
    else:
        with torch.no_grad():
            ent = ops.entropy_from_logits(logits)
    dist.backward(loss)
    n_local = float(m.sum())
    sums["pg_loss"] += pg.item()
    sums["vf_loss"] += vf.item()
    sums["loss"] += loss.item()
    sums["clipfrac_tok"] += float(pg_stats["clipfrac"]) * n_local
    sums["approx_kl_tok"] += float(pg_stats["approx_kl"]) * n_local
    sums["vf_clipfrac_tok"] += float(vf_stats["clipfrac"]) * n_local
    sums["entropy_tok"] += float(ops.masked_sum(ent.detach(), m))
    sums["tokens"] += n_local


# ------------------------------------------------------------------------------------------------
# Evaluation: same generation and reward step, plus metric_fn on the main rank


def evaluate(
    models: LoadedModels,
    reward_step: RewardStep,
    records: list[dict[str, Any]],
    query_ids: list[list[int]],
    metric_fn: MetricFn | None,
    cfg: Config,
    device: torch.device,
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    W, R = dist.world_size(), dist.rank()
    counts = split_evenly(len(records), W)
    offset = sum(counts[:R])
    mine = list(range(offset, offset + counts[R]))
    rounds = -(-max(counts) // cfg.rollout.chunk_size)
    t0 = time.perf_counter()
    # Evaluation must not move the training sampling stream (same guarantee as the reward step).
    with isolated_rng():
        ro, _, _ = collect_rollouts(models, reward_step, records, query_ids, mine, offset, rounds,
                                    cfg.rollout.chunk_size, cfg, device, cfg.eval.do_sample)
    totals = ro.total_rewards().tolist()
    local = [{"index": i, "prompt": p, "output": o, "reward": totals[k],
              "output_token_ids": ro.response_ids[k][ro.response_mask[k]].tolist(), "metadata": md}
             for k, (i, p, o, md) in enumerate(zip(ro.global_index, ro.prompts, ro.outputs, ro.metadata))]
    gathered = dist.gather_objects(local, dst=0)
    samples = [s for part in gathered or [] for s in part]  # every eval sample, on the main rank only

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

    status, payload = dist.run_on_main(score, describe=lambda e: _failure(e, 0))
    if status == "error":
        raise RewardError("metric_fn failed " + payload)
    payload["time/eval"] = time.perf_counter() - t0
    return payload, samples


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
    # -- inputs, all checked before any model is loaded
    cfg = load_config(config, list(overrides or []))
    inp = prepare_inputs(cfg, dist.expected_world_size(), reward_fn, metric_fn, prompts, eval_prompts)
    records, eval_records, reward_fns, metric_fn = inp.records, inp.eval_records, inp.reward_fns, inp.metric_fn
    query_ids, eval_query_ids, tokenizer = inp.query_ids, inp.eval_query_ids, inp.tokenizer
    _check_run_dir(cfg)

    # -- processes, seeds, models
    device = dist.init_accelerator(cfg.dist.timeout_s)
    W, R = dist.world_size(), dist.rank()
    plan = inp.plan
    assert plan.world_size == W, f"launcher said {plan.world_size} processes, the process group has {W}"
    torch.set_num_threads(cfg.train.num_threads or max(1, (os.cpu_count() or 1) // dist.local_world_size()))
    torch.manual_seed(cfg.train.seed)  # shared: any random init inside from_pretrained matches on all ranks
    models = _quiet(load_models, cfg.model, cfg.train.seed, tokenizer)
    models.policy.to(device)
    models.ref.to(device)
    seed_everything(cfg.train.seed, R)  # per-rank: generation sampling
    optimizer = torch.optim.AdamW(models.policy.parameters(), lr=cfg.ppo.lr, eps=cfg.ppo.adam_eps,
                                  weight_decay=cfg.ppo.weight_decay)
    total_steps = cfg.train.iterations * plan.optimizer_steps_per_iteration
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(cfg, total_steps))
    model, optimizer = dist.prepare(models.policy, optimizer)
    reward_step = RewardStep(reward_fns, cfg.reward.placement, cfg.reward.batch_size, models.tokenizer)
    state = TrainState(
        iteration=0,
        kl_ctl=(ops.AdaptiveKLController(cfg.ppo.init_kl_coef, cfg.ppo.target_kl, cfg.ppo.kl_horizon)
                if cfg.ppo.target_kl is not None else ops.FixedKLController(cfg.ppo.init_kl_coef)),
        reward_moments=ops.RunningMoments(),
        sampler=PromptSampler(len(records), cfg.train.seed, cfg.data.shuffle),
        shuffle_gen=torch.Generator().manual_seed(rank_seed(cfg.train.seed + 1, R)),
    )
    run_dir = Path(cfg.train.run_dir)
    resumed_from = _maybe_resume(cfg, run_dir, models, optimizer, scheduler, state) if cfg.train.resume else None
    if resumed_from is None and cfg.train.overwrite and dist.is_main():
        _clear_run_dir(run_dir)
    dist.barrier()
    writer = RunWriter(run_dir, cfg.train.tensorboard) if dist.is_main() else None
    if writer:
        (run_dir / "config.yaml").write_text(cfg.to_yaml())
    result = TrainResult(run_dir=run_dir)
    names = [f.name for f in reward_fns]
    _say(f"rallyrl: {W} process(es), {plan.num_rollouts} rollouts/iteration "
         f"({'/'.join(map(str, plan.local_counts))} per rank, {plan.rounds} chunk round(s)), "
         f"{cfg.train.iterations} iterations, reward placement '{cfg.reward.placement}'")

    def run_eval(step: int) -> dict[str, float]:
        if not eval_records:
            return {}
        metrics, samples = evaluate(models, reward_step, eval_records, eval_query_ids, metric_fn, cfg, device)
        if writer:
            writer.log_eval_samples(step, samples)
        _say("eval @ %d: %s" % (step, ", ".join(f"{k}={v:.4f}" for k, v in metrics.items() if k.startswith("eval/"))))
        return metrics

    try:
        if resumed_from is None:
            result.eval_before = {k: v for k, v in run_eval(0).items() if k.startswith("eval/")}
        else:
            _say(f"resumed from {resumed_from} at iteration {state.iteration}")
        bar = _progress(cfg, state.iteration)
        for it in range(state.iteration, cfg.train.iterations):
            step = it + 1
            t_iter = time.perf_counter()

            # 1-2. rollouts + central reward step
            global_idx = state.sampler.next(plan.num_rollouts)
            off = plan.offset(R)
            mine = global_idx[off : off + plan.local_count(R)]
            t0 = time.perf_counter()
            ro, rstats, rtimes = collect_rollouts(models, reward_step, records, query_ids, mine, off,
                                                  plan.rounds, plan.chunk_size, cfg, device,
                                                  cfg.generation.do_sample)
            t_rollout = time.perf_counter() - t0

            # 3-4. KL-shaped rewards and advantages
            rewards, seq_kl = shape_rewards(ro, state, cfg)
            advantages, returns = compute_advantages(ro, rewards, cfg)

            # 5. PPO epochs
            t0 = time.perf_counter()
            upd = ppo_update(model, optimizer, scheduler, ro, advantages, returns, state, cfg, device)
            t_update = time.perf_counter() - t0

            # 6. statistics (one all-reduce), KL controller, logs
            metrics = _iteration_metrics(ro, seq_kl, returns, rstats, upd, names, state, plan)
            state.kl_ctl.update(metrics["policy/kl"], plan.num_rollouts)
            metrics.update({f"time/{k.split('/')[1]}": v for k, v in rtimes.items()})
            metrics.update({"time/rollout": t_rollout, "time/update": t_update,
                            "time/reward_gather": rstats.time_gather,
                            "lr": scheduler.get_last_lr()[0]})
            if cfg.train.log_rollouts:
                _log_rollouts(writer, ro, step, R)
            if eval_records and ((cfg.eval.interval and step % cfg.eval.interval == 0)
                                 or step == cfg.train.iterations):
                evaluated = run_eval(step)
                metrics.update(evaluated)
                result.eval_after = {k: v for k, v in evaluated.items() if k.startswith("eval/")}
            state.iteration = step
            metrics["time/iteration"] = time.perf_counter() - t_iter
            if writer:
                writer.log_metrics(step, metrics)
                result.metrics.append(metrics)
            _summary(bar, step, cfg.train.iterations, metrics)

            # 7. checkpoint (collective; atomic)
            if cfg.checkpoint.interval and step % cfg.checkpoint.interval == 0:
                ckpt.save_checkpoint(run_dir, step, models.policy, optimizer, _state_dict(state, scheduler),
                                     state.shuffle_gen, cfg.checkpoint.keep_last)
        if bar is not None:
            bar.close()
        if cfg.train.save_final and dist.is_main():
            _quiet(_save_final, models, run_dir / "final")
        dist.barrier()
    finally:
        if writer:
            writer.close()
    return result


# ------------------------------------------------------------------------------------------------
# helpers of the recipe


def _state_dict(state: TrainState, scheduler: Any) -> dict[str, Any]:
    """Everything except weights, optimizer and RNG that the next iteration depends on (JSON-able)."""
    sched = {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}
    return {"iteration": state.iteration, "optimizer_steps": state.optimizer_steps,
            "kl_ctl": state.kl_ctl.state_dict(), "reward_moments": state.reward_moments.state_dict(),
            "sampler": state.sampler.state_dict(), "scheduler": sched}


def _maybe_resume(cfg: Config, run_dir: Path, models: LoadedModels, optimizer: Any, scheduler: Any,
                  state: TrainState) -> Path:
    """Restore the run from a checkpoint; the main rank picks it so every rank loads the same one."""
    status, path_s = dist.run_on_main(lambda: str(ckpt.resolve_resume(run_dir, cfg.train.resume or "latest")))
    if status == "error":
        raise ckpt.CheckpointError(path_s)
    path = Path(path_s)
    saved = ckpt.load_checkpoint(path, models.policy, optimizer, state.shuffle_gen)
    state.iteration = saved["iteration"]
    state.optimizer_steps = saved["optimizer_steps"]
    state.kl_ctl.load_state_dict(saved["kl_ctl"])
    state.reward_moments.load_state_dict(saved["reward_moments"])
    state.sampler.load_state_dict(saved["sampler"])
    scheduler.load_state_dict({**scheduler.state_dict(), **saved["scheduler"]})
    if dist.is_main():
        # A killed run may have logged iterations after its last checkpoint: drop them, so the logs
        # continue without duplicate or missing steps.
        for name in ("metrics.jsonl", "rollouts.jsonl"):
            _truncate_log(run_dir / name, state.iteration)
    dist.barrier()
    return path


def _truncate_log(path: Path, last_step: int) -> None:
    if not path.is_file():
        return
    keep = [line for line in path.read_text(encoding="utf-8").splitlines(keepends=True)
            if line.strip() and json.loads(line)["step"] <= last_step]
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(keep), encoding="utf-8")
    os.replace(tmp, path)


_RUN_OUTPUTS = ("metrics.jsonl", "rollouts.jsonl", "config.yaml", "eval", "checkpoints", "final", "tensorboard")


def _check_run_dir(cfg: Config) -> None:
    """Never append a fresh run to an earlier run's logs (that would silently mix two runs)."""
    run_dir = Path(cfg.train.run_dir)
    if cfg.train.resume or cfg.train.overwrite:
        return
    if (run_dir / "metrics.jsonl").exists() or (run_dir / "checkpoints").exists():
        raise ConfigError(
            f"train.run_dir {run_dir} already holds a run; resume it with train.resume=latest, start over "
            f"with train.overwrite=true, or choose another train.run_dir"
        )


def _clear_run_dir(run_dir: Path) -> None:
    import shutil

    for name in _RUN_OUTPUTS:
        p = run_dir / name
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()


def _required(v: Any, key: str) -> Any:
    if v is None:
        raise ConfigError(f"{key} is required (or pass it to train())")
    return v


def _lr_lambda(cfg: Config, total: int) -> Callable[[int], float]:
    warm, kind = cfg.ppo.warmup_steps, cfg.ppo.lr_schedule

    def f(step: int) -> float:
        if warm and step < warm:
            return (step + 1) / warm
        if kind == "constant" or total <= warm:
            return 1.0
        p = min(1.0, (step - warm) / max(1, total - warm))
        return 1.0 - p if kind == "linear" else 0.5 * (1 + math.cos(math.pi * p))

    return f


def _iteration_metrics(ro: Rollouts, seq_kl: torch.Tensor, returns: torch.Tensor, rstats: StepStats,
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
    steps = max(1.0, g["u_steps"] / W)
    utok = max(1.0, g["u_tokens"])
    out = {
        "reward/mean": mean,
        "reward/std": math.sqrt(max(0.0, g["reward_sq"] / n - mean**2) * n / max(1.0, n - 1)),
        "reward/calls": g["calls"],
        "reward/samples_per_call": g["samples"] / max(1.0, g["calls"]),
        "time/reward": g["time_reward"],
        "policy/kl": g["kl_sum"] / n,
        "policy/kl_coef": state.kl_ctl.value,
        "policy/response_length": g["len_sum"] / n,
        "policy/loss": g["u_pg_loss"] / W / steps,
        "policy/clipfrac": g["u_clipfrac_tok"] / utok,
        "policy/approx_kl": g["u_approx_kl_tok"] / utok,
        "policy/entropy": g["u_entropy_tok"] / utok,
        "value/loss": g["u_vf_loss"] / W / steps,
        "value/clipfrac": g["u_vf_clipfrac_tok"] / utok,
        "value/mean": g["value_sum"] / tok,
        "value/explained_variance": 1.0 - var_res / var_ret if var_ret > 1e-12 else 0.0,
        "loss/total": g["u_loss"] / W / steps,
        "opt/grad_norm": g["u_grad_norm"] / W / steps,
        "opt/steps": float(state.optimizer_steps),
    }
    if len(names) > 1:
        out.update({f"reward/{k}": g[f"c_{k}"] / n for k in names})
    return out


def _log_rollouts(writer: RunWriter | None, ro: Rollouts, step: int, rank: int) -> None:
    totals = ro.total_rewards().tolist()
    recs = [{"step": step, "rank": rank, "index": i, "prompt": p, "output": o, "reward": totals[k],
             "kl": float((ro.logprobs[k] - ro.ref_logprobs[k])[ro.response_mask[k]].sum())}
            for k, (i, p, o) in enumerate(zip(ro.global_index, ro.prompts, ro.outputs))]
    gathered = dist.gather_objects(recs, dst=0)
    if writer and gathered:
        writer.log_rollouts([r for part in gathered for r in part])


def _save_final(models: LoadedModels, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    models.policy.lm.save_pretrained(out, safe_serialization=True)
    models.tokenizer.save_pretrained(out)


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


def _say(msg: str) -> None:
    if dist.is_main():
        print(msg, file=sys.stderr, flush=True)


def _progress(cfg: Config, start: int) -> Any:
    if not (cfg.train.progress and dist.is_main()):
        return None
    from tqdm.auto import tqdm

    return tqdm(total=cfg.train.iterations, initial=start, desc="ppo", unit="it", file=sys.stderr,
                dynamic_ncols=True, leave=False)


def _summary(bar: Any, step: int, total: int, m: dict[str, float]) -> None:
    line = (f"iter {step}/{total} | reward {m['reward/mean']:.4f} | kl {m['policy/kl']:.4f} | "
            f"loss {m['loss/total']:.4f} | clipfrac {m['policy/clipfrac']:.3f} | {m['time/iteration']:.2f}s")
    extra = [f"{k}={v:.4f}" for k, v in m.items() if k.startswith("eval/")]
    if extra:
        line += " | " + " ".join(extra)
    if bar is not None:
        bar.update(1)
        bar.write(line, file=sys.stderr)
    elif dist.is_main():
        print(line, file=sys.stderr, flush=True)
