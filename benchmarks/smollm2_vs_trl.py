"""SmolLM2-135M PPO: rallyrl vs TRL's PPOTrainer on the same work (one process each).

Workers for the ``smollm2`` row of ``ppo_vs_trl`` (orchestrated by ``benchmarks/ppo_vs_trl.py``).
The model is SmolLM2-135M-Instruct converted to a plain Hugging Face folder by
``examples/sentiments/prepare.py:smollm2_dir()`` (not timed). Task: continue 16 review openers with
32-token responses; reward = VADER compound sentiment of the sample (``benchmarks/smollm2_task.py``).

Shared settings (rallyrl name / TRL name): 8 episodes per iteration (4 with ``--quick``;
``rollout.num_rollouts`` / ``per_device_train_batch_size``), one generation chunk of all of them
(``chunk_size`` / ``local_rollout_forward_batch_size``), 1 PPO epoch of 2 minibatches (2 optimizer
steps per iteration), AdamW lr 1e-5 constant, KL penalty 0.05 with the k1 estimator, gamma 1, lam 0.95, clip
0.2, value clip 0.2, vf_coef 0.1, no gradient clipping (TRL's PPO loop has none), advantages whitened,
sampling at temperature 1, top_k 0, top_p 1, at most 32 new tokens, stop at EOS, float32, 1 torch thread.
The value function starts at 0 in both (rallyrl: zero value head; TRL: a separate
``AutoModelForSequenceClassification`` copy of the model with its ``score`` zeroed).
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

from benchmarks import smollm2_task as task  # noqa: E402
from benchmarks.common import ENV, BenchError, loop_iteration_times, read_metrics, run_timed  # noqa: E402

EPISODES = 8  # per iteration (full run; `--quick` uses 4); one generation chunk of all of them
EPOCHS = 1
MINIBATCHES = 2
LR = 1e-5
KL_COEF = 0.05
VF_COEF = 0.1
MAX_NEW_TOKENS = 32
EVAL_SAMPLES_PER_PROMPT = 2
NAMES = {"trl1": "TRL PPOTrainer", "rallyrl1": "rallyrl"}


def model_dir() -> Path:
    try:
        from examples.sentiments.prepare import smollm2_dir
    except ImportError as e:
        raise BenchError("examples/sentiments/prepare.py:smollm2_dir is not in this checkout (branch issue8 "
                         f"provides it): {e}") from e
    return Path(smollm2_dir())


def rallyrl_config(model: str, run_dir: str, iterations: int, episodes: int = EPISODES) -> dict[str, Any]:
    return {
        "model": {"path": model, "dtype": "float32", "value_head": "linear", "value_head_std": 0.0},
        "data": {"prompts": task.TRAIN_PROMPTS},
        "train": {"seed": 0, "run_dir": run_dir, "iterations": iterations, "num_threads": 1, "progress": False,
                  "overwrite": True, "save_final": True},
        "rollout": {"num_rollouts": episodes, "chunk_size": episodes},
        "generation": {"max_new_tokens": MAX_NEW_TOKENS, "do_sample": True, "temperature": 1.0, "top_k": 0,
                       "top_p": 1.0},
        "ppo": {"epochs": EPOCHS, "num_minibatches": MINIBATCHES, "lr": LR, "lr_schedule": "constant",
                "init_kl_coef": KL_COEF, "kl_estimator": "k1", "max_grad_norm": None, "vf_coef": VF_COEF,
                "gamma": 1.0, "lam": 0.95, "clip_range": 0.2, "clip_range_value": 0.2,
                "whiten_advantages": True, "reward_scaling": "none", "weight_decay": 0.0},
        "reward": {"fn": "benchmarks.smollm2_task:reward_fn", "placement": "main"},
    }


def _preload() -> None:
    """Imports both systems make lazily while loading the model, done before any clock starts."""
    import accelerate  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    task.sentiment(["warm up the lexicon"])


def worker_rallyrl(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    import rallyrl
    import rallyrl.trainer  # noqa: F401

    _preload()
    t0 = time.perf_counter()
    rallyrl.train(rallyrl_config(args.model_dir, args.run_dir, args.iterations, args.episodes))
    return {"train_call_s": time.perf_counter() - t0, "final_dir": str(Path(args.run_dir) / "final")}


def worker_trl(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    import datasets
    from transformers import (AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer,
                              TrainerCallback, set_seed)
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    _preload()
    datasets.disable_progress_bars()
    set_seed(0)  # PPOTrainer does not seed numpy, which orders its minibatches
    run_dir = Path(args.run_dir)
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    if tok.pad_token is None:  # as rallyrl's loader does
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    policy = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    value = AutoModelForSequenceClassification.from_pretrained(args.model_dir, num_labels=1, dtype=torch.float32)
    with torch.no_grad():
        value.score.weight.zero_()  # first values 0, as rallyrl's zero value head
    reward = task.make_text_reward_model(tok, task.sentiment)

    def ids(prompts: list[str]) -> datasets.Dataset:
        return datasets.Dataset.from_dict({"input_ids": [tok(p)["input_ids"] for p in prompts]})

    episodes = args.episodes
    n_rep = -(-episodes * args.iterations // len(task.TRAIN_PROMPTS))
    cfg = PPOConfig(
        output_dir=str(run_dir), seed=0, use_cpu=True, bf16=False, gradient_checkpointing=False,
        report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True,
        per_device_train_batch_size=episodes, gradient_accumulation_steps=1, num_mini_batches=MINIBATCHES,
        num_ppo_epochs=EPOCHS, total_episodes=episodes * args.iterations, local_rollout_forward_batch_size=episodes,
        learning_rate=LR, lr_scheduler_type="constant", optim="adamw_torch", weight_decay=0.0,
        kl_coef=KL_COEF, kl_estimator="k1", gamma=1.0, lam=0.95, cliprange=0.2, cliprange_value=0.2,
        vf_coef=VF_COEF, whiten_rewards=False, response_length=MAX_NEW_TOKENS, temperature=1.0,
        stop_token="eos", missing_eos_penalty=None, num_sample_generations=0,
    )
    trainer = PPOTrainer(args=cfg, processing_class=tok, model=policy, ref_model=ref, reward_model=reward,
                         value_model=value, train_dataset=ids(task.TRAIN_PROMPTS * n_rep),
                         eval_dataset=ids(task.EVAL_PROMPTS))
    steps = [0]
    trainer.optimizer.optimizer.register_step_post_hook(lambda *a, **k: steps.__setitem__(0, steps[0] + 1))
    marks: list[float] = []

    class _Clock(TrainerCallback):
        def on_train_begin(self, *a: Any, **k: Any) -> None:
            marks.append(time.perf_counter())

        def on_step_end(self, *a: Any, **k: Any) -> None:
            marks.append(time.perf_counter())

    trainer.add_callback(_Clock())
    t1 = time.perf_counter()
    trainer.train()
    t2 = time.perf_counter()
    final = run_dir / "final"
    trainer.policy_model.save_pretrained(final, safe_serialization=True)
    tok.save_pretrained(final)
    return {"iterations": len(marks) - 1, "optimizer_steps": steps[0], "ppo_loop_s": t2 - t1, "setup_s": t1 - t0,
            "train_call_s": t2 - t0, "iteration_s": [b - a for a, b in zip(marks, marks[1:])],
            "reward_calls": reward.backbone.calls, "reward_samples": reward.backbone.samples,
            "reward_s": reward.backbone.seconds, "final_dir": str(final)}


def common_eval(model: str | Path, seed: int = 0) -> dict[str, Any]:
    """Mean reward of sampled continuations of the eval prompts (the same evaluator for every system)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(model)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    prompts = [p for p in task.EVAL_PROMPTS for _ in range(EVAL_SAMPLES_PER_PROMPT)]
    enc = tok(prompts, return_tensors="pt", padding=True)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = lm.generate(**enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                          max_new_tokens=MAX_NEW_TOKENS, pad_token_id=tok.pad_token_id)
    outputs = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    scores = task.sentiment([p + o for p, o in zip(prompts, outputs)])
    return {"eval_score": sum(scores) / len(scores), "eval_samples": len(scores)}


def run_system(system: str, model: Path, out_dir: Path, iterations: int, tag: str,
               episodes: int = EPISODES) -> dict[str, Any]:
    """One system in a fresh process; returns its per-iteration times, result and final score."""
    run_dir = out_dir / f"{system}_{tag}"
    result_file = out_dir / f"{system}_{tag}.result.json"
    result_file.unlink(missing_ok=True)
    worker = {"rallyrl1": "rallyrl", "trl1": "trl"}[system]
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", worker, "--model-dir", str(model),
           "--run-dir", str(run_dir), "--iterations", str(iterations), "--episodes", str(episodes),
           "--result", str(result_file)]
    print(f"[bench] smollm2 {tag} {system} (log {out_dir / f'{system}_{tag}.log'})", flush=True)
    proc = run_timed(cmd, out_dir / f"{system}_{tag}.log")
    res = json.loads(result_file.read_text())
    res.update(system=system, processes=1, process_s=proc["wall_s"], cpu_s=proc["cpu_s"], run_dir=str(run_dir))
    if system.startswith("rallyrl"):
        ms = read_metrics(run_dir)
        res["iteration_s"] = loop_iteration_times(ms)
        res["iterations"] = len(ms)
        res["ppo_loop_s"] = sum(res["iteration_s"])
    res.update(common_eval(res["final_dir"]))
    print(f"[bench] smollm2 {tag} {system}: loop {res['ppo_loop_s']:.1f}s over {res['iterations']} iterations, "
          f"eval score {res['eval_score']:.3f}", flush=True)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", choices=["rallyrl", "trl"], required=True)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--iterations", type=int, required=True)
    ap.add_argument("--episodes", type=int, default=EPISODES)
    ap.add_argument("--result", required=True)
    args = ap.parse_args(argv)
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    res = worker_rallyrl(args) if args.worker == "rallyrl" else worker_trl(args)
    Path(args.result).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
