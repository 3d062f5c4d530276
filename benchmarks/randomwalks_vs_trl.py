"""randomwalks PPO: rallyrl vs TRL's PPOTrainer (the baseline), measured in the same run.

    .venv-bench/bin/python benchmarks/randomwalks_vs_trl.py [--iterations 20] [--repeats 2]
        [--systems trl1,rallyrl1,rallyrl2,trl2] [--out runs/bench/randomwalks_vs_trl.json]

Both systems fine-tune the same pretrained randomwalks GPT-2 (``examples/randomwalks/prepare.py``; its
pretraining is not timed) on the same task with the same hyper-parameters: 128 rollouts per iteration,
4 PPO epochs x 2 minibatches of 64 (8 optimizer steps per iteration), AdamW lr 3e-4 (constant), no KL
penalty, gamma 1, lam 0.95, clip 0.2, value clip 0.2, vf_coef 1.2, no gradient clipping (TRL's PPO loop
has none, so rallyrl's is switched off too), responses of at most 9 tokens sampled at temperature 1,
top_k 0, top_p 1. See benchmarks/README.md for what differs and why.

Every system runs in a fresh Python process started by this script (so no system inherits imports,
caches or accelerate state from another), with one torch thread per process and
``OMP_NUM_THREADS=1``. Within a repeat the systems run back to back; the second repeat runs them in
reverse order, so a drift in machine load does not always favour the same system. Speed is reported
as RATIOS against TRL measured in the same repeat (DESIGN.md rule 11): timings on a shared machine are
noisy, ratios less so.

What is timed (all wall-clock, ``time.perf_counter``):

- ``ppo_loop_s`` (the headline number, used for the ratios): the PPO iterations only, without
  evaluation. rallyrl: sum of ``time/iteration`` from metrics.jsonl minus the final evaluation's
  ``time/eval`` (rallyrl runs the final eval inside the last iteration's timer). TRL:
  ``PPOTrainer.train()`` with ``num_sample_generations=0`` (so no evaluation inside it).
- ``sum_time_iteration_s`` (rallyrl only): the plain sum of ``time/iteration`` (includes the final eval).
- ``train_call_s``: rallyrl: the ``rallyrl.train(...)`` call (1 process; model loading, eval before
  and after, saving ``final/``), or the whole ``python -m rallyrl.cli train --nproc 2`` command
  (2 processes; includes interpreter and process-group start-up). TRL: building the models and the
  ``PPOTrainer`` plus ``train()`` (1 process; no eval), or, for 2 processes, rank 0's time from its
  imports done to ``train()`` returned.
- ``process_s``: the whole worker process (or process tree) as seen from this script: interpreter
  start, imports, everything above, the evaluations and saving the policy.
- ``cpu_s``: user + system CPU seconds of that process tree (less sensitive to other jobs than wall
  time; threads spinning while waiting in a collective count too).

Final optimality is measured twice: by rallyrl's own evaluation (``eval/optimality``, 200 sampled
walks; rallyrl only) and, for every system alike, by ``examples/randomwalks/evaluate.py``'s
``generate_walks`` on the saved final policy: 200 eval prompts sampled at temperature 1 with seed 0
(``eval_optimality``), and the mean over seeds 0-4 (1000 walks, ``eval_optimality_5seeds``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import (ENV, git_state, make_text_reward_model, read_metrics, run_timed, run_trl_ppo,  # noqa: E402
                               trl_ppo_args, versions, worker_main)

CONFIG = ROOT / "examples" / "randomwalks" / "config.yaml"
EVAL_PROMPTS = ROOT / "examples" / "randomwalks" / "eval_prompts.txt"
TRAIN_NODES = list("bcdefghijklmnopqrstu")  # data.prompts of config.yaml: every non-goal node

# The shared hyper-parameters (rallyrl names; the TRL names are in run_trl).
NUM_ROLLOUTS = 128
EPOCHS = 4
MINIBATCHES = 2
LR = 3e-4
MAX_NEW_TOKENS = 9
CHUNK = 64  # rallyrl rollout.chunk_size == TRL local_rollout_forward_batch_size
EVAL_SEEDS = (0, 1, 2, 3, 4)
PROCESSES = {"trl1": 1, "trl1_nogc": 1, "trl2": 2, "rallyrl1": 1, "rallyrl2": 2}
NAMES = {"trl1": "TRL PPOTrainer", "trl2": "TRL PPOTrainer", "rallyrl1": "rallyrl", "rallyrl2": "rallyrl",
         "trl1_nogc": "TRL PPOTrainer, its gc.collect() calls off (diagnostic)"}



def rallyrl_overrides(model_dir: Path, run_dir: Path, iterations: int) -> list[str]:
    """config.yaml already holds the shared hyper-parameters; these make the run comparable."""
    return [
        f"model.path={model_dir}",
        f"train.run_dir={run_dir}",
        "train.overwrite=true",
        f"train.iterations={iterations}",
        "train.num_threads=1",  # one torch thread per process, as for TRL
        "train.progress=false",
        "ppo.max_grad_norm=null",  # TRL's PPO loop does not clip gradients
        f"ppo.lr={LR}",  # the shipped config decays 5e-4 over 30 iterations; compare at TRL's settings
        "ppo.lr_schedule=constant",
        "rollout.logprobs_from=generate",  # the policy's log-probs from its own decoding, as TRL takes them
    ]


# ------------------------------------------------------------------------------------------------
# Workers (each runs in its own process)


def rallyrl_summary(run_dir: Path) -> dict[str, Any]:
    """Timings and results from a rallyrl run directory (the main rank's metrics.jsonl)."""
    ms = read_metrics(run_dir)  # step 0 (the evaluation before training) left out
    last = ms[-1]
    s_iter = sum(m["time/iteration"] for m in ms)
    t_eval = float(last.get("time/eval", 0.0))
    return {
        "iterations": len(ms),
        # `opt/steps` is being renamed `policy/optimizer_steps` (issue 12): read whichever the run logged
        "optimizer_steps": int(last.get("policy/optimizer_steps", last.get("opt/steps", 0))),
        "sum_time_iteration_s": s_iter,
        "final_eval_s": t_eval,
        "ppo_loop_s": s_iter - t_eval,
        "sum_time_rollout_s": sum(m["time/rollout"] for m in ms),
        "sum_time_update_s": sum(m["time/update"] for m in ms),
        "iteration_s": [m["time/iteration"] for m in ms],
        "rallyrl_eval_optimality": last.get("eval/optimality"),
        "final_reward_mean": last["reward/mean"],
    }


def _preload() -> None:
    """Import what both systems import lazily while loading the model (transformers' GPT-2 modelling,
    tokenizers, accelerate) before any clock starts, so ``train_call_s`` times work, not imports.
    Imports are counted in ``process_s``."""
    import accelerate  # noqa: F401
    import transformers.models.gpt2.modeling_gpt2  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401


def worker_rallyrl(args: argparse.Namespace) -> dict[str, Any]:
    """rallyrl on one process, in this process: ``rallyrl.train(...)``."""
    import torch

    torch.set_num_threads(1)
    import rallyrl
    import rallyrl.trainer  # noqa: F401 - rallyrl.train imports it lazily; before the clock, as for TRL
    from examples.randomwalks import task

    _preload()

    run_dir = Path(args.run_dir)
    t0 = time.perf_counter()
    result = rallyrl.train(
        str(CONFIG),
        reward_fn=task.reward_fn,
        prompts=TRAIN_NODES,
        eval_prompts=str(EVAL_PROMPTS),
        metric_fn=task.metric_fn,
        overrides=rallyrl_overrides(Path(args.model_dir), run_dir, args.iterations),
    )
    train_call = time.perf_counter() - t0
    out = rallyrl_summary(run_dir)
    out.update(train_call_s=train_call, eval_before=result.eval_before.get("eval/optimality"),
               torch_threads=torch.get_num_threads(), final_dir=str(run_dir / "final"))
    return out


def make_reward_model(tokenizer: Any) -> Any:
    """The randomwalks optimality as the ``nn.Module`` reward model TRL's PPO wants
    (``benchmarks.common.make_text_reward_model``): each row's real tokens decoded (special tokens
    skipped, as rallyrl decodes), scored by ``task.reward_fn``. reward_fn scores prompt + output, so
    where the walk is split does not change the score; TRL reads the optimality of the whole walk."""
    from examples.randomwalks import task

    return make_text_reward_model(tokenizer, lambda walks: task.reward_fn(walks, [w[:1] for w in walks],
                                                                          [w[1:] for w in walks]))


def trl_settings(run_dir: str | Path, iterations: int, world: int = 1) -> dict[str, Any]:
    """TRL's PPOConfig for the shared hyper-parameters (checked against rallyrl's: ``check_same_work``)."""
    return trl_ppo_args(run_dir=run_dir, episodes=NUM_ROLLOUTS, chunk=CHUNK, iterations=iterations, epochs=EPOCHS,
                        minibatches=MINIBATCHES, lr=LR, kl_coef=0.0, vf_coef=1.2, max_new_tokens=MAX_NEW_TOKENS,
                        world=world)


def rallyrl_settings(model_dir: Path, run_dir: Path, iterations: int) -> Any:
    from rallyrl.config import load_config

    return load_config(str(CONFIG), rallyrl_overrides(model_dir, run_dir, iterations))


def worker_trl(args: argparse.Namespace) -> dict[str, Any]:
    """TRL's PPOTrainer on 1 process, or one rank of N (``benchmarks.common.run_trl_ppo``)."""
    import torch

    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    import trl.experimental.ppo  # noqa: F401 - imported before the clock, as rallyrl's modules are

    _preload()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    tok.padding_side = "left"
    eval_nodes = [line.strip() for line in EVAL_PROMPTS.read_text().splitlines() if line.strip()]
    # uniform over start nodes, like rallyrl's 20 shuffled prompts
    return run_trl_ppo(trl_settings(args.run_dir, args.iterations, world), args.model_dir, tok,
                       [tok(n)["input_ids"] for n in TRAIN_NODES * 64], [tok(n)["input_ids"] for n in eval_nodes],
                       make_reward_model, no_gc_collect=args.no_gc_collect)


# ------------------------------------------------------------------------------------------------
# Orchestrator


def common_eval(model_dir: Path | str) -> dict[str, float]:
    """Optimality of sampled walks (temperature 1, top_k 0, top_p 1) on the 200 eval prompts."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from examples.randomwalks import task
    from examples.randomwalks.evaluate import generate_walks

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    graph = task.default_graph()
    prompts = [line.strip() for line in EVAL_PROMPTS.read_text().splitlines() if line.strip()]
    per_seed = []
    for seed in EVAL_SEEDS:
        outs = generate_walks(model, tok, prompts, do_sample=True, seed=seed)
        per_seed.append(sum(task.optimality(graph, p, o) for p, o in zip(prompts, outs)) / len(prompts))
    return {"eval_optimality": per_seed[0], "eval_optimality_5seeds": sum(per_seed) / len(per_seed),
            "eval_optimality_per_seed": per_seed}


def run_system(system: str, model_dir: Path, out_dir: Path, iterations: int, tag: str) -> dict[str, Any]:
    run_dir = out_dir / f"{system}_{tag}"
    result_file = out_dir / f"{system}_{tag}.result.json"
    log = out_dir / f"{system}_{tag}.log"
    result_file.unlink(missing_ok=True)
    me = [sys.executable, str(Path(__file__).resolve())]
    common = ["--model-dir", str(model_dir), "--run-dir", str(run_dir), "--iterations", str(iterations),
              "--result", str(result_file)]
    if system == "rallyrl1":
        cmd = me + ["--worker", "rallyrl"] + common
    elif system == "rallyrl2":
        cmd = [sys.executable, "-m", "rallyrl.cli", "train", str(CONFIG), "--nproc", "2"]
        for o in rallyrl_overrides(model_dir, run_dir, iterations):
            cmd += ["--set", o]
    elif system in ("trl1", "trl2", "trl1_nogc"):
        n = PROCESSES[system]
        cmd = me + ["--worker", "trl"] + common + (["--no-gc-collect"] if system.endswith("_nogc") else [])
        if n > 1:  # the same launcher rallyrl's CLI uses; accelerate picks up RANK/WORLD_SIZE (gloo on CPU)
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}"] + cmd[1:]
    else:
        raise ValueError(system)
    load0 = os.getloadavg()[0]
    print(f"[bench] {tag} {system}: {' '.join(cmd[:6])} ... (log {log})", flush=True)
    proc = run_timed(cmd, log)  # a failure raises BenchError with the log's tail
    wall, cpu = proc["wall_s"], proc["cpu_s"]
    if system == "rallyrl2":
        res = rallyrl_summary(run_dir)
        res.update(train_call_s=wall, final_dir=str(run_dir / "final"))
    else:
        res = json.loads(result_file.read_text())
    res.update(system=system, processes=PROCESSES[system], process_s=wall, cpu_s=cpu,
               load_1min_before=load0, load_1min_after=os.getloadavg()[0])
    res.update(common_eval(res["final_dir"]))
    res["s_per_optimizer_step"] = res["ppo_loop_s"] / max(1, res["optimizer_steps"])
    print(f"[bench] {tag} {system}: ppo loop {res['ppo_loop_s']:.1f}s, {res['optimizer_steps']} steps, "
          f"process {wall:.1f}s, cpu {cpu:.1f}s, eval optimality {res['eval_optimality']:.3f} "
          f"(5 seeds {res['eval_optimality_5seeds']:.3f})", flush=True)
    return res


def add_ratios(results: list[dict[str, Any]]) -> None:
    """Ratios against TRL on 1 process of the same repeat (and TRL on 2 processes for 2-process runs)."""
    by = {r["system"]: r for r in results}
    base1 = by.get("trl1")
    for r in results:
        for key, base in (("vs_trl1", base1), ("vs_trl2", by.get("trl2") if r["processes"] == 2 else None)):
            if base is None:
                continue
            r[f"ratio_ppo_loop_{key}"] = r["ppo_loop_s"] / base["ppo_loop_s"]
            r[f"ratio_s_per_step_{key}"] = r["s_per_optimizer_step"] / base["s_per_optimizer_step"]
            r[f"ratio_process_{key}"] = r["process_s"] / base["process_s"]
            r[f"ratio_cpu_{key}"] = r["cpu_s"] / base["cpu_s"]


def table(repeats: list[list[dict[str, Any]]]) -> str:
    head = ("| repeat | system | processes | PPO loop s | s / optimizer step | ratio vs TRL 1 proc | "
            "ratio vs TRL 2 proc | "
            "train call s | process s | CPU s | final eval optimality (seed 0; 5 seeds) | "
            "rallyrl eval/optimality | optimizer steps |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for i, rep in enumerate(repeats, 1):
        for r in sorted(rep, key=lambda r: list(PROCESSES).index(r["system"])):
            ratio = r.get("ratio_ppo_loop_vs_trl1")
            ratio_s = "1 (baseline)" if r["system"] == "trl1" else (f"{ratio:.2f}" if ratio is not None else "-")
            ratio2 = r.get("ratio_ppo_loop_vs_trl2")
            ratio2_s = "-" if ratio2 is None else ("1" if r["system"] == "trl2" else f"{ratio2:.2f}")
            own = r.get("rallyrl_eval_optimality")
            lines.append(
                f"| {i} | {NAMES[r['system']]} | {r['processes']} | {r['ppo_loop_s']:.1f} | "
                f"{r['s_per_optimizer_step']:.3f} | {ratio_s} | {ratio2_s} | {r['train_call_s']:.1f} | {r['process_s']:.1f} | "
                f"{r['cpu_s']:.1f} | {r['eval_optimality']:.3f}; {r['eval_optimality_5seeds']:.3f} | "
                f"{'-' if own is None else f'{own:.3f}'} | {r['optimizer_steps']} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--systems", default="trl1,rallyrl1,rallyrl2,trl2,trl1_nogc",
                    help="comma-separated, run in this order (reversed in every second repeat)")
    ap.add_argument("--out", default="runs/bench/randomwalks_vs_trl.json")
    # worker mode (internal)
    ap.add_argument("--worker", choices=["rallyrl", "trl"], help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--no-gc-collect", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for k, v in ENV.items():
        os.environ.setdefault(k, v)

    if args.worker:
        return worker_main(args, worker_rallyrl, worker_trl)

    from examples.randomwalks.prepare import default_model_dir, prepare_model

    model_dir = prepare_model(default_model_dir(), progress=False)  # cached: pretraining is not timed
    out_path = ROOT / args.out
    out_dir = out_path.parent / out_path.stem  # logs and run directories
    out_dir.mkdir(parents=True, exist_ok=True)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    started = datetime.datetime.now().astimezone()
    report: dict[str, Any] = {
        "benchmark": "randomwalks PPO, rallyrl vs TRL PPOTrainer",
        "date": started.isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).relative_to(ROOT).as_posix()
                             if sys.executable.startswith(str(ROOT)) else sys.executable,
                             "benchmarks/randomwalks_vs_trl.py"] + (argv if argv is not None else sys.argv[1:])),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch_threads_per_process": 1,
                    "load_1min_at_start": os.getloadavg()[0]},
        "versions": versions(),
        "git": git_state(),
        "settings": {"iterations": args.iterations, "rollouts_per_iteration": NUM_ROLLOUTS, "ppo_epochs": EPOCHS,
                     "minibatches": MINIBATCHES, "optimizer_steps": args.iterations * EPOCHS * MINIBATCHES,
                     "lr": LR, "kl_coef": 0.0, "gamma": 1.0, "lam": 0.95, "cliprange": 0.2,
                     "cliprange_value": 0.2, "vf_coef": 1.2, "max_grad_norm": None,
                     "max_new_tokens": MAX_NEW_TOKENS, "temperature": 1.0, "top_k": 0, "top_p": 1.0,
                     "generation_chunk": CHUNK, "model_dir": str(model_dir)},
        "pretrained": common_eval(model_dir),
        "repeats": [],
    }
    for rep in range(args.repeats):
        order = systems if rep % 2 == 0 else systems[::-1]
        results = [run_system(s, model_dir, out_dir, args.iterations, f"r{rep + 1}") for s in order]
        add_ratios(results)
        report["repeats"].append(results)
        out_path.write_text(json.dumps(report, indent=2))  # partial results survive a later failure
    report["finished"] = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    report["table_markdown"] = table(report["repeats"])
    out_path.write_text(json.dumps(report, indent=2))
    print(report["table_markdown"])
    print(f"[bench] wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
