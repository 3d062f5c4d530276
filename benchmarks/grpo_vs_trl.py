"""GRPO throughput: rallyrl ``ppo.estimator: grpo`` vs TRL 1.12's ``GRPOTrainer``, same work, one process each.

    .venv-bench/bin/python benchmarks/grpo_vs_trl.py [--quick] [--out runs/bench/grpo_vs_trl.json]

Row ``randomwalks``: the pretrained randomwalks GPT-2 (``examples/randomwalks/prepare.py``, not timed) and
``examples/randomwalks/grpo.yaml``'s settings: per iteration 16 start nodes x G = 8 sampled walks = 128
completions of at most 9 tokens (temperature 1, top_k 0, top_p 1, stop at EOS), rewards = optimality,
group-normalised advantages (unbiased group std), beta 0 (no reference model in either system), one pass
(rallyrl ``ppo.epochs: 1`` / TRL ``num_iterations=1``) in 2 optimizer steps of 64 completions (rallyrl
``ppo.num_minibatches: 2`` / TRL ``per_device_train_batch_size=64, steps_per_generation=2,
gradient_accumulation_steps=1``), clip 0.2 both sides, a token-level mean loss (rallyrl ``token_mean`` /
TRL ``loss_type="dapo"``), fused AdamW lr 1e-3 decayed linearly to 0 over the run's optimizer steps,
gradient clipping 1.0, float32, no gradient checkpointing, no vLLM. TRL computes the old log-probs with
a separate forward pass after generation here (its steps_per_generation > gradient_accumulation_steps),
as rallyrl's default ``rollout.logprobs_from: forward`` does. ``check_same_work`` compares the loaded
rallyrl ``Config`` with the ``GRPOConfig`` arguments before anything runs.

Timing as ``ppo_vs_trl``: each system in a fresh process, the two back to back in each repeat, the order
reversed every second repeat; episodes/s after one warm-up iteration. rallyrl's iteration =
``time/iteration`` minus ``time/eval``; TRL's = the time between every second ``on_step_end`` callback
(2 optimizer steps = one generation batch), the first from ``on_train_begin``. TRL's profile comes from
timing wrappers on its trainer's own methods (``_generate`` -> generate, ``_calculate_rewards`` ->
reward, ``_get_per_token_logps_and_entropies`` inside ``_generate_and_score_completions`` -> forward, the
rest of that method -> other, everything after it in the iteration -> update). Final score: sampled
optimality of the saved final policy, 200 eval prompts x seeds 0-4, by the same evaluator for both.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import ENV, BenchError, loop_iteration_times, read_metrics, run_timed  # noqa: E402

CONFIG = ROOT / "examples" / "randomwalks" / "grpo.yaml"
EVAL_PROMPTS = ROOT / "examples" / "randomwalks" / "eval_prompts.txt"
TRAIN_NODES = list("bcdefghijklmnopqrstu")  # grpo.yaml's data.prompts

NUM_ROLLOUTS = 128
G = 8
MINIBATCHES = 2  # optimizer steps per iteration (TRL: steps_per_generation)
EPOCHS = 1  # TRL: num_iterations
LR = 1e-3
MAX_NEW_TOKENS = 9
CHUNK = 128  # TRL generates a whole generation batch (per device) in one generate() call; rallyrl too
# iterations per run, repeats (full, quick)
PLAN = {"randomwalks": {"full": (30, 3), "quick": (3, 1)}}
SYSTEMS = ("trl1", "rallyrl1")


def rallyrl_overrides(model_dir: Path | str, run_dir: Path | str, iterations: int) -> list[str]:
    """grpo.yaml holds the shared settings; these make the run comparable (one thread, no mid-run eval, the
    whole iteration's 128 completions in one generate() call as TRL's generation batch)."""
    return [f"model.path={model_dir}", f"train.run_dir={run_dir}", "train.overwrite=true",
            f"train.iterations={iterations}", "train.num_threads=1", "train.progress=false", "eval.interval=0",
            f"rollout.chunk_size={CHUNK}"]


def rallyrl_settings(model_dir: Path | str, run_dir: Path | str, iterations: int) -> Any:
    from rallyrl.config import load_config

    return load_config(str(CONFIG), rallyrl_overrides(model_dir, run_dir, iterations))


def trl_grpo_args(*, run_dir: str | Path, iterations: int, world: int = 1) -> dict[str, Any]:
    """``GRPOConfig`` keyword arguments for the row (checked against rallyrl's by ``check_same_work``)."""
    return dict(
        output_dir=str(run_dir), seed=0, use_cpu=True, bf16=False, gradient_checkpointing=False, report_to="none",
        save_strategy="no", logging_steps=1, disable_tqdm=True, use_vllm=False,
        per_device_train_batch_size=NUM_ROLLOUTS // MINIBATCHES // world, gradient_accumulation_steps=1,
        steps_per_generation=MINIBATCHES, num_generations=G, num_iterations=EPOCHS,
        max_steps=iterations * MINIBATCHES, learning_rate=LR, lr_scheduler_type="linear", warmup_steps=0,
        optim="adamw_torch_fused", weight_decay=0.0, adam_epsilon=1e-8, max_grad_norm=1.0,
        beta=0.0, epsilon=0.2, epsilon_high=0.2, loss_type="dapo", scale_rewards="group",
        max_completion_length=MAX_NEW_TOKENS, temperature=1.0, top_k=0, top_p=1.0,
        mask_truncated_completions=False,
    )


def same_work_mismatches(cfg: Any, trl: dict[str, Any], world: int = 1) -> list[str]:
    """Where a rallyrl ``Config`` and TRL ``GRPOConfig`` kwargs would NOT do the same work (empty: same)."""
    p, g, m = cfg.ppo, cfg.generation, cfg.model
    steps_per_iteration = trl["steps_per_generation"] // trl["gradient_accumulation_steps"]
    pairs = {
        "completions per iteration": (cfg.rollout.num_rollouts,
                                      trl["per_device_train_batch_size"] * trl["steps_per_generation"] * world),
        "generation batch per process (one generate() call)": (
            cfg.rollout.chunk_size, trl["per_device_train_batch_size"] * trl["steps_per_generation"]),
        "completions per prompt (G)": (cfg.rollout.samples_per_prompt, trl["num_generations"]),
        "estimator": (p.estimator, "grpo"),
        "advantage scaling": (p.group_scale, trl["scale_rewards"]),
        "passes over each batch": (p.epochs, trl["num_iterations"]),
        "optimizer steps per iteration": (p.num_minibatches, steps_per_iteration),
        "one micro-batch per minibatch": (p.micro_batch_size, None),
        "lr": (p.lr, trl["learning_rate"]),
        "lr schedule": (p.lr_schedule, trl["lr_scheduler_type"]),
        "warm-up steps": (p.warmup_steps, trl["warmup_steps"]),
        "optimizer": ("fused AdamW", {"adamw_torch_fused": "fused AdamW"}.get(trl["optim"], trl["optim"])),
        "weight decay": (p.weight_decay, trl["weight_decay"]),
        "adam eps": (p.adam_eps, trl["adam_epsilon"]),
        "gradient clipping": (p.max_grad_norm, trl["max_grad_norm"]),
        "beta (KL coefficient)": (p.init_kl_coef, trl["beta"]),
        "adaptive KL (TRL: none)": (p.target_kl, None),
        "clip range": (p.clip_range, trl["epsilon"]),
        "upper clip range": (p.clip_range if p.clip_range_high is None else p.clip_range_high,
                             trl["epsilon"] if trl.get("epsilon_high") is None else trl["epsilon_high"]),
        "loss aggregation": (p.loss_aggregation, {"dapo": "token_mean", "dr_grpo": "seq_mean_token_sum",
                                                  "grpo": "seq_mean_token_mean"}.get(trl["loss_type"])),
        "zero-std groups kept": (p.drop_zero_std_groups, False),
        "entropy bonus (TRL: none)": (p.entropy_coef, 0.0),
        "reward scaling": (p.reward_scaling, "none"),
        "reward clip": (p.reward_clip, None),
        "response length": (g.max_new_tokens, trl["max_completion_length"]),
        "sampling": (g.do_sample, True),
        "temperature": (g.temperature, trl["temperature"]),
        "top_k (0 = off)": (g.top_k or 0, trl["top_k"] or 0),
        "top_p": (g.top_p, trl["top_p"]),
        "stop strings (TRL: EOS only)": (list(g.stop_sequences), []),
        "truncated completions kept": (True, not trl["mask_truncated_completions"]),
        "dtype": (m.dtype, "bfloat16" if trl["bf16"] else "float32"),
        # steps_per_generation > gradient_accumulation_steps: TRL recomputes the old log-probs in a
        # forward pass after generation, as rallyrl's logprobs_from=forward does.
        "old log-probs from a forward pass": (cfg.rollout.logprobs_from,
                                              "forward" if steps_per_iteration > 1 else "generate"),
        "no vLLM": (True, not trl["use_vllm"]),
    }
    return [f"{k}: rallyrl {a!r} vs TRL {b!r}" for k, (a, b) in pairs.items() if a != b]


def check_same_work(cfg: Any, trl: dict[str, Any], world: int = 1) -> None:
    bad = same_work_mismatches(cfg, trl, world)
    if bad:
        raise BenchError("rallyrl and TRL GRPO would not do the same work: " + "; ".join(bad))


# ------------------------------------------------------------------------------------------------
# Workers (each in its own process)


def _reward(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    from examples.randomwalks import task

    return task.reward_fn([p + c for p, c in zip(prompts, completions)], prompts, completions)


def worker_rallyrl(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    import rallyrl
    import rallyrl.trainer  # noqa: F401 - imported before the clock, as TRL's modules are
    from benchmarks.randomwalks_vs_trl import _preload, rallyrl_summary
    from examples.randomwalks import task

    _preload()
    run_dir = Path(args.run_dir)
    t0 = time.perf_counter()
    rallyrl.train(str(CONFIG), reward_fn=task.reward_fn, prompts=TRAIN_NODES, eval_prompts=str(EVAL_PROMPTS),
                  metric_fn=task.metric_fn, overrides=rallyrl_overrides(args.model_dir, run_dir, args.iterations))
    out = rallyrl_summary(run_dir)
    out.update(train_call_s=time.perf_counter() - t0, final_dir=str(run_dir / "final"),
               iteration_s=loop_iteration_times(read_metrics(run_dir)))
    return out


class TrlGrpoClock:
    """Per-iteration phase split of TRL's GRPOTrainer by timing wrappers on the trainer's own methods
    (instance attributes; the work is unchanged): ``_generate`` (generate), ``_calculate_rewards``
    (reward), ``_get_per_token_logps_and_entropies`` while ``_generate_and_score_completions`` runs
    (forward: the old log-probs), the rest of that method (other); the iteration's remaining time is the
    update (the 2 optimizer steps' forward/backward/step and Trainer bookkeeping)."""

    PHASES = ("generate", "forward", "reward", "update", "other")

    def __init__(self, trainer: Any) -> None:
        self.rows: list[dict[str, float]] = []
        self._in_rollout = False
        self._reset(time.perf_counter())
        for name in ("_generate", "_calculate_rewards", "_get_per_token_logps_and_entropies",
                     "_generate_and_score_completions"):
            setattr(trainer, name, self._wrap(name, getattr(trainer, name)))

    def _reset(self, t: float) -> None:
        self._start = t
        self._acc = {"generate": 0.0, "forward": 0.0, "reward": 0.0, "rollout": 0.0}

    def _wrap(self, name: str, fn: Any) -> Any:
        def timed(*a: Any, **k: Any) -> Any:
            outer = name == "_generate_and_score_completions"
            if outer:
                self._in_rollout = True
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                dt = time.perf_counter() - t0
                if outer:
                    self._in_rollout = False
                    self._acc["rollout"] += dt
                elif name == "_generate":
                    self._acc["generate"] += dt
                elif name == "_calculate_rewards":
                    self._acc["reward"] += dt
                elif self._in_rollout:
                    self._acc["forward"] += dt
        return timed

    def begin(self) -> None:
        self._reset(time.perf_counter())

    def end_iteration(self) -> None:
        t = time.perf_counter()
        it = t - self._start
        a = self._acc
        self.rows.append({"iteration_s": it, "generate": a["generate"], "forward": a["forward"],
                          "reward": a["reward"], "other": a["rollout"] - a["generate"] - a["forward"] - a["reward"],
                          "update": it - a["rollout"]})
        self._reset(t)


def worker_trl(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback, set_seed
    from trl import GRPOConfig, GRPOTrainer

    from benchmarks.randomwalks_vs_trl import _preload

    _preload()
    datasets.disable_progress_bars()
    set_seed(0)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    run_dir = Path(args.run_dir)
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    tok.padding_side = "left"
    policy = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    # uniform over start nodes, like rallyrl's shuffled 20 prompts
    train = datasets.Dataset.from_dict({"prompt": TRAIN_NODES * 64})
    trainer = GRPOTrainer(model=policy, reward_funcs=_reward, args=GRPOConfig(**trl_grpo_args(
        run_dir=run_dir, iterations=args.iterations, world=world)), train_dataset=train, processing_class=tok)
    clock = TrlGrpoClock(trainer)
    steps = [0]
    trainer.create_optimizer_and_scheduler(num_training_steps=args.iterations * MINIBATCHES)
    trainer.optimizer.register_step_post_hook(lambda *a, **k: steps.__setitem__(0, steps[0] + 1))
    marks: list[float] = []

    class _Clock(TrainerCallback):
        def on_train_begin(self, *a: Any, **k: Any) -> None:
            marks.append(time.perf_counter())
            clock.begin()

        def on_step_end(self, state_args: Any, state: Any, *a: Any, **k: Any) -> None:
            if state.global_step % MINIBATCHES == 0:  # one generation batch = MINIBATCHES optimizer steps
                marks.append(time.perf_counter())
                clock.end_iteration()

    trainer.add_callback(_Clock())
    t1 = time.perf_counter()
    trainer.train()
    t2 = time.perf_counter()
    opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate wraps it
    final = run_dir / "final"
    out = {"iterations": len(marks) - 1, "optimizer_steps": steps[0], "ppo_loop_s": t2 - t1, "setup_s": t1 - t0,
           "train_call_s": t2 - t0, "iteration_s": [b - a for a, b in zip(marks, marks[1:])],
           "grpo_phases_per_iteration": clock.rows, "torch_threads": torch.get_num_threads(), "final_dir": str(final),
           "optimizer": type(opt).__name__, "optimizer_fused": bool(opt.defaults.get("fused"))}
    if int(os.environ.get("RANK", "0")) == 0:
        trainer.model.save_pretrained(final, safe_serialization=True)
        tok.save_pretrained(final)
    return out


# ------------------------------------------------------------------------------------------------
# Orchestrator


def run_system(system: str, model_dir: Path, out_dir: Path, iterations: int, tag: str) -> dict[str, Any]:
    from benchmarks.randomwalks_vs_trl import common_eval

    run_dir = out_dir / f"{system}_{tag}"
    result_file = out_dir / f"{system}_{tag}.result.json"
    log = out_dir / f"{system}_{tag}.log"
    result_file.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "rallyrl" if system == "rallyrl1" else "trl",
           "--model-dir", str(model_dir), "--run-dir", str(run_dir), "--iterations", str(iterations),
           "--result", str(result_file)]
    load0 = os.getloadavg()[0]
    print(f"[bench] grpo {tag} {system} (log {log})", flush=True)
    proc = run_timed(cmd, log)
    res = json.loads(result_file.read_text())
    res.update(system=system, processes=1, process_s=proc["wall_s"], cpu_s=proc["cpu_s"], run_dir=str(run_dir),
               load_1min_before=load0, load_1min_after=os.getloadavg()[0])
    res.update(common_eval(res["final_dir"]))
    print(f"[bench] grpo {tag} {system}: loop {sum(res['iteration_s']):.1f}s, {res['iterations']} iterations, "
          f"{res['optimizer_steps']} steps, eval optimality {res['eval_optimality_5seeds']:.3f} (5 seeds)", flush=True)
    return res


def run_randomwalks(iterations: int, repeats: int, out_dir: Path, quick: bool = False) -> dict[str, Any]:
    from benchmarks.ppo_vs_trl import WARMUP, check_runs_did_the_same_work, interleaved, mean_profile, summarise_row
    from benchmarks.randomwalks_vs_trl import common_eval
    from examples.randomwalks.prepare import default_model_dir, prepare_model

    model = prepare_model(default_model_dir(), progress=False)  # cached; pretraining is not timed
    d = out_dir / "randomwalks"
    d.mkdir(parents=True, exist_ok=True)
    check_same_work(rallyrl_settings(model, d / "check", iterations), trl_grpo_args(run_dir=d / "check",
                                                                                   iterations=iterations))
    runs = []
    for rep in range(repeats):
        for system in interleaved(SYSTEMS, rep):
            res = run_system(system, model, d, iterations, f"r{rep + 1}")
            res["repeat"] = rep + 1
            runs.append(res)
    check_runs_did_the_same_work(runs)
    row = summarise_row(runs, NUM_ROLLOUTS, "eval_optimality_5seeds")
    trl = [r for r in runs if r["system"] == "trl1"]
    # summarise_row's TRL profile reads PPO phases; GRPO's have their own names
    row["trl1"]["profile"] = mean_profile([_grpo_profile(r["grpo_phases_per_iteration"], WARMUP) for r in trl])
    row.update(task_score="sampled optimality of the final policy, 200 eval prompts x seeds 0-4 "
               "(examples/randomwalks/evaluate.py)", pretrained_score=common_eval(model)["eval_optimality_5seeds"],
               model="randomwalks GPT-2 (examples/randomwalks/prepare.py)", iterations=iterations, repeats=repeats,
               settings={"completions_per_iteration": NUM_ROLLOUTS, "G": G, "passes": EPOCHS,
                         "optimizer_steps_per_iteration": MINIBATCHES, "max_new_tokens": MAX_NEW_TOKENS, "lr": LR,
                         "lr_schedule": "linear", "beta": 0.0, "loss": "token mean (TRL loss_type dapo)"},
               runs=runs)
    return row


def _grpo_profile(rows: list[dict[str, float]], warmup: int) -> dict[str, Any]:
    import statistics

    from benchmarks.common import steady

    rows = steady(rows, warmup)
    it = statistics.fmean(r["iteration_s"] for r in rows)
    return {"iteration_s": it, "phases": {ph: {"s": (s := statistics.fmean(r[ph] for r in rows)),
                                               "share": s / it if it > 0 else 0.0} for ph in TrlGrpoClock.PHASES}}


ROWS = {"randomwalks": run_randomwalks}


def run(quick: bool, rows: list[str], out_dir: Path) -> dict[str, Any]:
    report: dict[str, Any] = {}
    for name in rows:
        iterations, repeats = PLAN[name]["quick" if quick else "full"]
        t0 = time.perf_counter()
        try:
            report[name] = ROWS[name](iterations, repeats, out_dir, quick)
        except BenchError as e:
            report[name] = {"error": str(e)[-2000:]}
            print(f"[bench] grpo_vs_trl {name} FAILED: {e}", flush=True)
        report[name]["wall_s"] = time.perf_counter() - t0
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--out", default="runs/bench/grpo_vs_trl.json")
    ap.add_argument("--worker", choices=["rallyrl", "trl"], help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", help=argparse.SUPPRESS)
    ap.add_argument("--iterations", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    if args.worker:
        res = worker_rallyrl(args) if args.worker == "rallyrl" else worker_trl(args)
        if int(os.environ.get("RANK", "0")) == 0:
            Path(args.result).write_text(json.dumps(res, indent=2))
        return 0
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    out = ROOT / args.out
    report = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
              **run(args.quick, rows, out.parent / out.stem)}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(json.dumps({r: report[r].get("ratio", report[r].get("error")) for r in rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
