"""`make demo`: pretrain (or reuse) the randomwalks GPT-2, then PPO on 2 processes, reward on rank 0.

    python examples/randomwalks/run.py [--config examples/randomwalks/grpo.yaml] [--nproc 2] [--set key=value ...]

Prints the evaluation optimality (200 sampled walks) before and after training and the time of each phase.
`--config examples/randomwalks/grpo.yaml` trains with GRPO (no value head, no reference) instead of PPO.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from examples.randomwalks.prepare import default_model_dir, prepare_model  # noqa: E402

CONFIG = ROOT / "examples" / "randomwalks" / "config.yaml"


def _mean_optimality(path: Path) -> tuple[float, int]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sum(r["optimality"] for r in rows) / len(rows), len(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(CONFIG), help="config.yaml (PPO, default) or grpo.yaml")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--run-dir", default=None, help="default runs/randomwalks (config.yaml), runs/randomwalks-<name> otherwise")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

    t0 = time.perf_counter()
    model_dir = prepare_model(default_model_dir())
    t_prepare = time.perf_counter() - t0

    stem = Path(args.config).stem
    run_dir = ROOT / (args.run_dir or ("runs/randomwalks" if stem == "config" else f"runs/randomwalks-{stem}"))
    cmd = [sys.executable, "-m", "rallyrl.cli", "train", args.config, "--nproc", str(args.nproc),
           "--set", f"model.path={model_dir}", "--set", f"train.run_dir={run_dir}", "--set", "train.overwrite=true"]
    for o in args.overrides:
        cmd += ["--set", o]
    t1 = time.perf_counter()
    rc = subprocess.call(cmd, cwd=ROOT)
    t_ppo = time.perf_counter() - t1
    if rc != 0:
        print(f"randomwalks: training failed (exit {rc})", file=sys.stderr)
        return rc

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    metrics = [m for m in rows if m["step"] >= 1]  # the step-0 row is the evaluation before training
    before, n = _mean_optimality(run_dir / "eval" / "step_0.jsonl")
    last = metrics[-1]
    after, n_after = _mean_optimality(run_dir / "eval" / f"step_{last['step']}.jsonl")
    loop = sum(m["time/iteration"] for m in metrics)
    print(f"\nrandomwalks: eval optimality {before:.3f} -> {after:.3f} ({n_after} sampled walks; "
          f"random walks score ~0.3)")
    print(f"randomwalks: {len(metrics)} iterations, {int(last['policy/optimizer_steps'])} optimizer steps; "
          f"training loop {loop:.1f}s (incl. evals), training command {t_ppo:.1f}s incl. start-up, "
          f"prepare {t_prepare:.1f}s; run dir {run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
