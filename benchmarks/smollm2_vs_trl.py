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
from benchmarks.common import (ENV, BenchError, first_key, loop_iteration_times, read_metrics, run_timed,  # noqa: E402
                               run_trl_ppo, trl_ppo_args)

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


def rallyrl_config(model: str, run_dir: str, iterations: int, episodes: int = EPISODES,
                   max_new_tokens: int = MAX_NEW_TOKENS) -> dict[str, Any]:
    return {
        "model": {"path": model, "dtype": "float32", "value_head": "linear", "value_head_std": 0.0},
        "data": {"prompts": task.TRAIN_PROMPTS},
        "train": {"seed": 0, "run_dir": run_dir, "iterations": iterations, "num_threads": 1, "progress": False,
                  "overwrite": True, "save_final": True},
        # logprobs_from: the policy's log-probs (and values) from its own decoding, as TRL takes them
        "rollout": {"num_rollouts": episodes, "chunk_size": episodes, "logprobs_from": "generate"},
        "generation": {"max_new_tokens": max_new_tokens, "do_sample": True, "temperature": 1.0, "top_k": 0,
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
    rallyrl.train(rallyrl_config(args.model_dir, args.run_dir, args.iterations, args.episodes, args.max_new_tokens))
    return {"train_call_s": time.perf_counter() - t0, "final_dir": str(Path(args.run_dir) / "final")}


def trl_settings(run_dir: str | Path, iterations: int, episodes: int = EPISODES,
                 max_new_tokens: int = MAX_NEW_TOKENS) -> dict[str, Any]:
    """TRL's PPOConfig for the shared settings (checked against rallyrl's: ``check_same_work``)."""
    return trl_ppo_args(run_dir=run_dir, episodes=episodes, chunk=episodes, iterations=iterations, epochs=EPOCHS,
                        minibatches=MINIBATCHES, lr=LR, kl_coef=KL_COEF, vf_coef=VF_COEF, max_new_tokens=max_new_tokens)


def worker_trl(args: argparse.Namespace) -> dict[str, Any]:
    """TRL's PPOTrainer on one process (``benchmarks.common.run_trl_ppo``)."""
    import torch

    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    import trl.experimental.ppo  # noqa: F401 - imported before the clock, as rallyrl's modules are

    _preload()
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    if tok.pad_token is None:  # as rallyrl's loader does
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    n_rep = -(-args.episodes * args.iterations // len(task.TRAIN_PROMPTS))
    return run_trl_ppo(trl_settings(args.run_dir, args.iterations, args.episodes, args.max_new_tokens), args.model_dir, tok,
                       [tok(p)["input_ids"] for p in task.TRAIN_PROMPTS * n_rep],
                       [tok(p)["input_ids"] for p in task.EVAL_PROMPTS],
                       lambda t: task.make_text_reward_model(t, task.sentiment))


def common_eval(model: str | Path, seed: int = 0, max_new_tokens: int = MAX_NEW_TOKENS) -> dict[str, Any]:
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
                          max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id)
    outputs = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    scores = task.sentiment([p + o for p, o in zip(prompts, outputs)])
    return {"eval_score": sum(scores) / len(scores), "eval_samples": len(scores)}


def run_system(system: str, model: Path, out_dir: Path, iterations: int, tag: str,
               episodes: int = EPISODES, max_new_tokens: int = MAX_NEW_TOKENS) -> dict[str, Any]:
    """One system in a fresh process; returns its per-iteration times, result and final score."""
    run_dir = out_dir / f"{system}_{tag}"
    result_file = out_dir / f"{system}_{tag}.result.json"
    result_file.unlink(missing_ok=True)
    worker = {"rallyrl1": "rallyrl", "trl1": "trl"}[system]
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", worker, "--model-dir", str(model),
           "--run-dir", str(run_dir), "--iterations", str(iterations), "--episodes", str(episodes),
           "--max-new-tokens", str(max_new_tokens),
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
        res["optimizer_steps"] = int(first_key(ms[-1], "policy/optimizer_steps", "opt/steps", default=0))
    res.update(common_eval(res["final_dir"], max_new_tokens=max_new_tokens))
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
    ap.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS)
    ap.add_argument("--result", required=True)
    args = ap.parse_args(argv)
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    res = worker_rallyrl(args) if args.worker == "rallyrl" else worker_trl(args)
    Path(args.result).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
