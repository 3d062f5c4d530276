"""Every phase of a steady rallyrl iteration against a bare-torch floor doing the same work.

    .venv-bench/bin/python benchmarks/floors.py [--quick] [--tasks randomwalks,smollm2]
        [--out runs/bench/floors.json]

For each task (the ``ppo_vs_trl`` rows' models and settings, see ``TASKS``) one fresh process (one
torch thread, ``OMP_NUM_THREADS=1``) builds rallyrl's models, optimizer and train state as
``rallyrl.train`` does (``trainer._build``), then times, per phase, the function the trainer calls
against a floor written with bare torch / transformers calls on the SAME modules and the same inputs:

- ``generate``: ``rollout.run_episodes`` through the HF engine (pad, ``lm.generate``, cut at EOS, decode) per chunk round vs
  one bare ``lm.generate(input_ids, attention_mask, max_new_tokens, do_sample, temperature, top_k, top_p,
  pad/eos ids)`` per round on the already padded prompts. Both sides start from the same torch seed;
  the floor's tokens, cut at EOS, must equal rallyrl's (checked every pair: the same work).
- ``score``: ``rollout.score_tokens`` (policy log-probs + values, reference log-probs) vs a bare no-grad
  forward of the policy LM (+ its value head on the last hidden state) and of the reference LM on
  ``[query | response]`` with the same position ids and ``logits_to_keep``, log-softmax and gather.
  The floor's log-probs must match rallyrl's (checked every pair).
- ``update``: ``trainer.ppo_update`` vs a minimal loop: same model (the policy LM + value head), same
  batch, same minibatch order (the same generator state), same micro-batches trimmed to their longest
  row, the same clipped policy + clipped value loss over the minibatch token count, ``backward``,
  ``clip_grad_norm_`` and a fused AdamW step. It logs nothing and never reads a tensor on the host
  beyond the row lengths.

A steady iteration: one whole rallyrl iteration and one of each floor run first (warm-up, untimed);
then ``pairs`` pairs, each on a fresh batch (the trainer's prompt sampler and reward step build it,
untimed), each phase's two sides run back to back, in alternating order (rallyrl first in even pairs).
Per phase: ``ratio`` = the median over pairs of rallyrl s / floor s (``pair_ratio``: its min, median,
max), and ``ratio_of_medians`` = median(rallyrl s) / median(floor s). The 1-minute load average is read
before and after each task (2 shared cores).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import ENV, BenchError, run_timed, spread  # noqa: E402

PHASES = ("generate", "score", "update")
GOAL = 1.10
# timed pairs per task (full, quick); each pair is one iteration's worth of every phase on both sides
PAIRS = {"randomwalks": {"full": 41, "quick": 2}, "smollm2": {"full": 7, "quick": 2}}
# SmolLM2 per iteration (episodes, response tokens), as ppo_vs_trl (quick: a smoke test of the row)
SMOLLM2_WORK = {"full": (8, 32), "quick": (4, 8)}
# What floors changes in the ppo_vs_trl settings so that every phase exists and is what a user runs:
# the policy's rollout log-probs from a forward pass (rallyrl's default; ppo_vs_trl takes them from
# generate, as TRL does, which leaves no policy pass to score), a reference (randomwalks has no KL
# penalty, hence no reference, in its shipped config), gradient clipping at 1.0 (the shipped default).
FLOOR_OVERRIDES = ["rollout.logprobs_from=forward", "ppo.max_grad_norm=1.0", "ppo.init_kl_coef=0.05"]


# ------------------------------------------------------------------------------------------------
# The report (pure; tested in tests/unit/test_bench.py)


def pair_order(pair: int) -> tuple[str, str]:
    """Which side runs first in a pair: rallyrl in even pairs, the floor in odd ones."""
    return ("rallyrl", "floor") if pair % 2 == 0 else ("floor", "rallyrl")


def summarise_phase(rallyrl_s: Sequence[float], floor_s: Sequence[float]) -> dict[str, Any]:
    """One phase's pairs -> seconds of each side (median, min, max) and ``ratio``: the median of the
    per-pair ratios rallyrl s / floor s (each pair runs back to back, so a change of machine load
    between pairs cancels within a pair; the sides' own medians can come from differently loaded
    pairs), with their spread (``pair_ratio``); ``ratio_of_medians`` = median(rallyrl) / median(floor)."""
    if len(rallyrl_s) != len(floor_s) or not rallyrl_s:
        raise BenchError(f"need as many rallyrl as floor timings, at least one: {len(rallyrl_s)} vs {len(floor_s)}")
    if min(floor_s) <= 0:
        raise BenchError(f"non-positive floor time {min(floor_s)}")
    pair_ratio = spread([a / b for a, b in zip(rallyrl_s, floor_s)])
    return {"rallyrl_s": spread(list(rallyrl_s)), "floor_s": spread(list(floor_s)), "ratio": pair_ratio["median"],
            "ratio_of_medians": statistics.median(rallyrl_s) / statistics.median(floor_s),
            "pair_ratio": pair_ratio, "pairs": len(rallyrl_s),
            "rallyrl_s_each": list(rallyrl_s), "floor_s_each": list(floor_s)}


def summarise_task(timings: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    """``{phase: {"rallyrl": [s...], "floor": [s...]}}`` -> ``{phase: summarise_phase(...)}``."""
    return {ph: summarise_phase(t["rallyrl"], t["floor"]) for ph, t in timings.items()}


# ------------------------------------------------------------------------------------------------
# The orchestrator: one fresh process per task


def run(quick: bool, tasks: Sequence[str], out_dir: Path) -> dict[str, Any]:
    """Run each task's worker in its own process; a task that fails is reported (``"error"``)."""
    report: dict[str, Any] = {"goal_ratio": GOAL, "processes": 1, "torch_threads": 1,
                              "overrides_of_ppo_vs_trl_settings": FLOOR_OVERRIDES}
    out_dir.mkdir(parents=True, exist_ok=True)
    for task in tasks:
        res = out_dir / f"{task}.json"
        load0 = os.getloadavg()[0]
        t0 = time.perf_counter()
        try:
            run_timed([sys.executable, str(Path(__file__).resolve()), "--worker", task, "--result", str(res)]
                      + (["--quick"] if quick else []), out_dir / f"{task}.log")
            report[task] = json.loads(res.read_text())
        except BenchError as e:
            report[task] = {"error": str(e)[-2000:]}
            print(f"[bench] floors {task} FAILED: {e}", flush=True)
        report[task].update(wall_s=time.perf_counter() - t0, load_1min_start=load0, load_1min_end=os.getloadavg()[0])
    return report


# ------------------------------------------------------------------------------------------------
# The worker (one task, in this process)


def task_config(task: str, quick: bool, run_dir: Path) -> tuple[Any, dict[str, Any]]:
    """The rallyrl ``Config`` of a task and the ``prepare_inputs`` keyword arguments it needs."""
    from rallyrl.config import load_config

    if task == "randomwalks":
        from benchmarks import randomwalks_vs_trl as rw
        from examples.randomwalks import task as rw_task
        from examples.randomwalks.prepare import default_model_dir, prepare_model

        model = prepare_model(default_model_dir(), progress=False)  # cached
        ov = [o for o in rw.rallyrl_overrides(model, run_dir, 1) if not o.startswith(("rollout.logprobs_from",
                                                                                     "ppo.max_grad_norm"))]
        cfg = load_config(str(rw.CONFIG), ov + FLOOR_OVERRIDES)
        return cfg, {"reward_fn": rw_task.reward_fn, "prompts": rw.TRAIN_NODES}
    if task == "smollm2":
        from benchmarks import smollm2_vs_trl as sm

        episodes, tokens = SMOLLM2_WORK["quick" if quick else "full"]
        cfg = load_config(sm.rallyrl_config(str(sm.model_dir()), str(run_dir), 1, episodes, tokens), FLOOR_OVERRIDES)
        return cfg, {}
    raise BenchError(f"unknown task {task!r}; tasks are {list(PAIRS)}")


class Floors:
    """The bare-torch floor of each phase, on the trainer's own modules (no rallyrl code runs in it)."""

    def __init__(self, models: Any, cfg: Any) -> None:
        import torch

        self.lm, self.v_head, self.ref_lm = models.policy.lm, models.policy.v_head, models.reference.lm
        self.tok, self.gen, self.ppo = models.tokenizer, cfg.generation, cfg.ppo
        self.params = [p for p in models.policy.parameters() if p.requires_grad]
        # its own optimizer state over the same parameters: fused AdamW, rallyrl's settings
        self.opt = torch.optim.AdamW(self.params, lr=cfg.ppo.lr, eps=cfg.ppo.adam_eps,
                                     weight_decay=cfg.ppo.weight_decay, fused=True)

    def generate(self, rounds: list[tuple[Any, Any]]) -> list[Any]:
        g, tok = self.gen, self.tok
        return [self.lm.generate(input_ids=q, attention_mask=qm, max_new_tokens=g.max_new_tokens, do_sample=True,
                                 temperature=g.temperature, top_k=g.top_k or None, top_p=g.top_p,
                                 pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)[:, q.shape[1]:]
                for q, qm in rounds]

    def score(self, rounds: list[tuple[Any, Any, Any, Any]]) -> list[tuple[Any, Any, Any]]:
        import torch

        out = []
        with torch.no_grad():
            for q, qm, r, rm in rounds:
                T = r.shape[1]
                ids, mask = torch.cat([q, r], 1), torch.cat([qm, rm], 1)
                pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
                o = self.lm(input_ids=ids, attention_mask=mask, position_ids=pos, output_hidden_states=True,
                            use_cache=False, logits_to_keep=T + 1)
                lp = torch.log_softmax(o.logits[:, :-1].float() / self.gen.temperature, -1).gather(-1, r[..., None])[..., 0]
                v = self.v_head(o.hidden_states[-1][:, -(T + 1):-1]).squeeze(-1)
                ro = self.ref_lm(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False,
                                 logits_to_keep=T + 1)
                ref = torch.log_softmax(ro.logits[:, :-1].float() / self.gen.temperature, -1).gather(-1, r[..., None])[..., 0]
                out.append((lp * rm, v * rm, ref * rm))
        return out

    def update(self, ro: Any, advantages: Any, returns: Any, shuffle: Any) -> None:
        """PPO epochs: per minibatch, micro-batches of ``micro_batch_size`` rows trimmed to their
        longest query/response, clipped policy + value loss over the minibatch's token count."""
        import torch

        ppo, temp = self.ppo, self.gen.temperature
        B = ro.response_ids.shape[0]
        resp_len, query_len = torch.stack([ro.response_mask.sum(1), ro.query_mask.sum(1)]).tolist()
        Q = ro.query_ids.shape[1]
        for _ in range(ppo.epochs):
            perm = torch.randperm(B, generator=shuffle)
            for mb in torch.tensor_split(perm, ppo.num_minibatches):
                self.opt.zero_grad(set_to_none=True)
                n = ro.response_mask[mb].sum().clamp(min=1)
                rows_all = mb.tolist()
                size = ppo.micro_batch_size or len(rows_all)
                for a in range(0, len(rows_all), size):
                    rows = rows_all[a:a + size]
                    T, q0 = max(resp_len[i] for i in rows), Q - max(query_len[i] for i in rows)
                    idx = torch.tensor(rows)
                    q, qm = ro.query_ids[idx, q0:], ro.query_mask[idx, q0:]
                    r, m = ro.response_ids[idx, :T], ro.response_mask[idx, :T]
                    ids, mask = torch.cat([q, r], 1), torch.cat([qm, m], 1)
                    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
                    o = self.lm(input_ids=ids, attention_mask=mask, position_ids=pos, output_hidden_states=True,
                                use_cache=False, logits_to_keep=T + 1)
                    lp = torch.log_softmax(o.logits[:, :-1].float() / temp, -1).gather(-1, r[..., None])[..., 0]
                    v = self.v_head(o.hidden_states[-1][:, -(T + 1):-1]).squeeze(-1).float()
                    adv, old_lp = advantages[idx, :T], ro.logprobs[idx, :T]
                    old_v, ret = ro.values[idx, :T], returns[idx, :T]
                    ratio = torch.exp(torch.where(m, lp - old_lp, 0.0))
                    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - ppo.clip_range, 1 + ppo.clip_range))
                    v_clip = old_v + (v - old_v).clamp(-ppo.clip_range_value, ppo.clip_range_value)
                    vf = 0.5 * torch.maximum((v - ret).square(), (v_clip - ret).square())
                    loss = (torch.where(m, pg, 0.0).sum() + ppo.vf_coef * torch.where(m, vf, 0.0).sum()) / n
                    loss.backward()
                torch.nn.utils.clip_grad_norm_(self.params, ppo.max_grad_norm)
                self.opt.step()


def worker(task: str, quick: bool, result: Path) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    from rallyrl import dist, rollout, trainer
    from rallyrl.inputs import prepare_inputs
    from rallyrl.reward.step import Samples
    from rallyrl.rollout import Rollouts

    run_dir = result.parent / f"{task}_run"
    cfg, kwargs = task_config(task, quick, run_dir)
    inp = prepare_inputs(cfg, 1, **kwargs)
    device = dist.init_accelerator(cfg.dist.timeout_s, cfg.model.sharding, cfg.train.mixed_precision)
    models, learner, state = trainer._build(cfg, inp, device)  # exactly what train() builds
    if models.reference is None or models.policy.v_head is None:
        raise BenchError("floors measures PPO with a value head and a reference (see FLOOR_OVERRIDES)")
    floors = Floors(models, cfg)
    gen, tok, temp = cfg.generation, models.tokenizer, cfg.generation.temperature
    timings = {ph: {"rallyrl": [], "floor": []} for ph in PHASES}
    checks = {"generate_same_tokens": 0, "score_max_abs_diff": 0.0}

    with trainer._reward_host(cfg, inp) as reward_step:
        reward_step.open()
        # warm-up: one whole iteration through the trainer's stages, then each floor once
        shard = trainer._next_shard(inp.plan, state, inp.train_set)
        engine, spec = trainer._engine(cfg, models, state, device)
        ro, _, _ = trainer.collect_rollouts(models, engine, reward_step, inp.train_set, shard, spec, device)
        adv = trainer.compute_advantages(ro, state, cfg.ppo)
        trainer.ppo_update(learner, ro, adv, state, cfg.ppo, temp, gen.max_new_tokens, device)

        def timed(fn: Any) -> tuple[Any, float]:
            t0 = time.perf_counter()
            out = fn()
            return out, time.perf_counter() - t0

        for p in range(-1, PAIRS[task]["quick" if quick else "full"]):  # pair -1: the floors' warm-up
            shard = trainer._next_shard(inp.plan, state, inp.train_set)
            chunks = [shard.indices[r * shard.chunk_size:(r + 1) * shard.chunk_size] for r in range(shard.rounds)]
            ids = [inp.train_set.token_ids(c) for c in chunks]
            padded = [rollout.pad(x, tok.pad_token_id, left=True) for x in ids]
            seed = 1000 + p
            res: dict[str, Any] = {}
            for side in pair_order(p):
                torch.manual_seed(seed)  # the same sampling stream on both sides: the same tokens
                if side == "rallyrl":
                    res[side], s = timed(lambda: [rollout.run_episodes(engine, tok, x, spec) for x in ids])
                else:
                    res[side], s = timed(lambda: floors.generate(padded))
                if p >= 0:
                    timings["generate"][side].append(s)
            gs = res["rallyrl"]
            for g, raw in zip(gs, res["floor"]):
                cut = [row[: row.index(tok.eos_token_id) + 1] if tok.eos_token_id in row else row for row in raw.tolist()]
                if cut != g.response_lists:
                    raise BenchError(f"{task}: the floor's generate() sampled other tokens than rallyrl's: not the same work")
            checks["generate_same_tokens"] += 1
            for side in pair_order(p):
                if side == "rallyrl":
                    res[side], s = timed(lambda: [rollout.score_tokens(models.policy, models.reference, g, temp, device)
                                                  for g in gs])
                else:
                    res[side], s = timed(lambda: floors.score([(g.query_ids, g.query_mask, g.response_ids,
                                                                g.response_mask) for g in gs]))
                if p >= 0:
                    timings["score"][side].append(s)
            for sc, (lp, v, ref) in zip(res["rallyrl"], res["floor"]):
                d = max(float((sc.logprobs - lp).abs().max()), float((sc.ref_logprobs - ref).abs().max()),
                        float((sc.values - v).abs().max()))
                if d > 1e-4:
                    raise BenchError(f"{task}: the floor's scoring pass differs from rallyrl's by {d}: not the same work")
                checks["score_max_abs_diff"] = max(checks["score_max_abs_diff"], d)
            # the batch of this pair, as collect_rollouts makes it (untimed)
            parts = []
            for r, (g, sc) in enumerate(zip(gs, res["rallyrl"])):
                texts, meta = inp.train_set.texts(chunks[r]), inp.train_set.metadata(chunks[r])
                (rewards, _), = reward_step.collect([reward_step.submit(Samples(texts, g.outputs, g.response_lists, meta))])
                first = shard.first_index + r * shard.chunk_size
                parts.append(Rollouts.from_chunk(g, sc, rewards, texts, meta, list(range(first, first + len(g))),
                                                 shard.group_size))
            ro = Rollouts.concat(parts, tok.pad_token_id)
            adv = trainer.compute_advantages(ro, state, cfg.ppo)
            shuffle_state = state.shuffle_gen.get_state()
            for side in pair_order(p):
                if side == "rallyrl":
                    state.shuffle_gen.set_state(shuffle_state)
                    _, s = timed(lambda: trainer.ppo_update(learner, ro, adv, state, cfg.ppo, temp,
                                                            gen.max_new_tokens, device))
                else:
                    g2 = torch.Generator().manual_seed(0)
                    g2.set_state(shuffle_state)
                    _, s = timed(lambda: floors.update(ro, adv.advantages, adv.returns, g2))
                if p >= 0:
                    timings["update"][side].append(s)
    out = {"phases": summarise_task(timings), "checks": checks,
           "settings": {"episodes_per_iteration": cfg.rollout.num_rollouts, "chunk_size": cfg.rollout.chunk_size,
                        "max_new_tokens": gen.max_new_tokens, "ppo_epochs": cfg.ppo.epochs,
                        "minibatches": cfg.ppo.num_minibatches, "micro_batch_size": cfg.ppo.micro_batch_size,
                        "kl_coef": cfg.ppo.init_kl_coef, "max_grad_norm": cfg.ppo.max_grad_norm,
                        "dtype": cfg.model.dtype, "model": str(cfg.model.path)},
           "torch_threads": torch.get_num_threads(), "optimizer_fused": bool(learner.optimizer.defaults.get("fused")),
           "rallyrl_package": str(Path(trainer.__file__).parent)}
    result.write_text(json.dumps(out, indent=2))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tasks", default=",".join(PAIRS))
    ap.add_argument("--out", default="runs/bench/floors.json")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    if args.worker:
        worker(args.worker, args.quick, Path(args.result))
        return 0
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    bad = [t for t in tasks if t not in PAIRS]
    if bad:
        ap.error(f"unknown task(s) {bad}; tasks are {list(PAIRS)}")
    out = ROOT / args.out
    report = run(args.quick, tasks, out.parent / out.stem)
    out.write_text(json.dumps(report, indent=2))
    print(json.dumps({t: report[t].get("error") or {ph: round(v["ratio"], 3) for ph, v in report[t]["phases"].items()}
                      for t in tasks}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
