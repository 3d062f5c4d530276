"""Bit-identity of runs before and after a change: the same fixed runs made from two source trees.

The fourth-wave restructure (engines, episodes, one job per room) promised every run bit-identical to
the commit before it. This script makes that comparison reproducible: it exports the ``--before`` commit
with ``git archive`` (nothing copied by hand), builds the tiny models once, runs the same configs from
both trees in the same environment and compares, run by run:

- every tensor of ``final/`` (safetensors), exactly;
- ``metrics.jsonl`` without the wall-clock and memory keys (``time/*``, ``memory/*``), exactly (a metric
  added since ``BASE`` is left out only while it holds its one possible value here: ``ADDED``);
- ``rollouts.jsonl`` (every sample, its reward and advantage), exactly.

The runs: PPO (GAE, value head, adaptive KL, eval) on 2 processes; GRPO (G 4, KL in the loss, k3,
``logprobs_from: generate``) on 2 processes with the reward on rank 0; T5 PPO on 1 process; RLOO (G 2)
under ``model.sharding: fsdp`` on 2 processes; and a resumed run (3 iterations, the last one lost after the
step-2 checkpoint and redone from it), which must also equal its own uninterrupted run.

Options that change the last bits on purpose are pinned off where they would (``PINNED``): the critic-free
runs (grpo, fsdp) and t5 (a prompt drawn twice in one batch) run with ``model.prefill_once: false`` on
every side that has the option, since its forward of a repeated prompt once gives the same numbers within
float rounding, not the same bits (docs/scaling.md, CHANGELOG); the other runs keep every default.

    python benchmarks/identity.py                  # before = BASE below, after = this working tree
    python benchmarks/identity.py --before HEAD~3 --runs ppo,grpo --keep /tmp/identity

Exit 0 when every run is identical, 1 otherwise (the first differences are printed).
tests/dist/test_identity_before_after.py runs it in the test suite.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# The last commit before the fourth-wave restructure (issue 27): what "unchanged" means.
BASE = "93f8694"

PROMPTS = ["the cat", "a dog", "good morning", "what a", "i like", "the sun", "we walk", "birds sing",
           "my friend", "the rain"]
EVAL = ["the cat sat", "a dog ran", "good day"]


def _config(model: Path, run_dir: Path, sections: dict[str, dict[str, Any]]) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "model": {"path": str(model)},
        "data": {"prompts": PROMPTS},
        "train": {"run_dir": str(run_dir), "iterations": 2, "seed": 3, "progress": False, "num_threads": 1},
        "rollout": {"num_rollouts": 7, "chunk_size": 2},
        "generation": {"max_new_tokens": 6},
        "ppo": {"epochs": 2, "num_minibatches": 2, "lr": 1e-3},
        "reward": {"fn": "tests.helpers.rewards:hashed"},
    }
    for k, v in sections.items():
        cfg.setdefault(k, {}).update(v)
    return cfg


# name -> (processes, model ("gpt2" or "t5"), config sections)
RUNS: dict[str, tuple[int, str, dict[str, dict[str, Any]]]] = {
    "ppo": (2, "gpt2", {"ppo": {"target_kl": 0.1, "micro_batch_size": 1, "entropy_coef": 0.01},
                        "data": {"eval_prompts": EVAL}, "eval": {"interval": 1},
                        "generation": {"stop_sequences": ["."]}}),
    "grpo": (2, "gpt2", {"rollout": {"num_rollouts": 8, "samples_per_prompt": 4, "chunk_size": 3,
                                     "logprobs_from": "generate"},
                         "ppo": {"estimator": "grpo", "kl_in": "loss", "kl_estimator": "k3",
                                 "loss_aggregation": "seq_mean_token_mean", "clip_range_high": 0.28},
                         "reward": {"batch_size": 3}}),
    "t5": (1, "t5", {"model": {"arch": "seq2seq"}, "rollout": {"logprobs_from": "generate"}}),
    "fsdp": (2, "gpt2", {"model": {"sharding": "fsdp"}, "rollout": {"num_rollouts": 8, "samples_per_prompt": 2},
                         "ppo": {"estimator": "rloo", "kl_in": "loss"}}),
    "resume": (2, "gpt2", {"train": {"iterations": 3}, "checkpoint": {"interval": 1, "keep_last": 3}}),
}
VOLATILE = ("time/", "memory/")
# Options that change the last bits of some runs on purpose (same results within float rounding, not bit
# for bit), pinned off in those runs on every side whose tree has them (the before tree predates them):
# - model.prefill_once (issue 29, default on): a prompt repeated in a batch runs once in the scoring and
#   training forwards. The critic-free runs repeat every prompt G times (grpo: the reference pass and the
#   update; fsdp: the policy runs its two passes on every batch there), and t5's second iteration draws a
#   prompt twice (7 rollouts per iteration from 10 prompts: the next pass over the data begins inside its
#   batch), so its update encodes that prompt once; the other runs stay identical with it on.
PINNED: dict[str, dict[str, dict[str, Any]]] = {
    "grpo": {"model": {"prefill_once": False}},
    "fsdp": {"model": {"prefill_once": False}},
    "t5": {"model": {"prefill_once": False}},
}
# Metrics added after BASE, left out of the comparison only while they hold the one value these runs can
# give (no reward function here returns None: reward/unscorable is 0); any other value is a difference.
ADDED = {"reward/unscorable": 0.0}


def export(ref: str, dest: Path) -> Path:
    """The tree of commit ``ref`` in ``dest`` (git archive: exactly what was committed)."""
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", ref], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def build_models(out: Path) -> dict[str, Path]:
    """The tiny GPT-2 and T5 (built once, by this tree's builders, and read by both sides)."""
    sys.path.insert(0, str(ROOT))
    from rallyrl.testing import build_tiny_gpt2, build_tiny_t5

    return {"gpt2": build_tiny_gpt2(out / "gpt2"), "t5": build_tiny_t5(out / "t5")}


def _env(src: Path) -> dict[str, str]:
    e = dict(os.environ)
    e.update({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
              "OMP_NUM_THREADS": "1", "PYTHONPATH": str(src)})
    return e


def _train(src: Path, cfg: dict[str, Any], path: Path, nproc: int, *extra: str) -> None:
    import yaml

    path.write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "rallyrl.cli", "train", str(path), "--nproc", str(nproc), *extra]
    p = subprocess.run(cmd, cwd=src, env=_env(src), capture_output=True, text=True, timeout=600)
    if p.returncode:
        raise RuntimeError(f"{' '.join(cmd)} (in {src}) exited {p.returncode}:\n{p.stderr[-3000:]}")


def make_run(src: Path, name: str, models: dict[str, Path], out: Path) -> Path:
    """Run ``name`` from the tree ``src`` into ``out/name``; the resumed run also into ``out/name-cut``."""
    nproc, model, sections = RUNS[name]
    out.mkdir(parents=True, exist_ok=True)
    run_dir = out / name
    sections = _pinned(src, name, sections)
    cfg = _config(models[model], run_dir, sections)
    _train(src, cfg, out / f"{name}.yaml", nproc)
    if name == "resume":  # as a run killed after its step-2 checkpoint leaves it, then resumed
        cut = out / f"{name}-cut"
        (cut / "checkpoints").mkdir(parents=True)
        shutil.copytree(run_dir / "checkpoints" / "step_2", cut / "checkpoints" / "step_2")
        for log in ("metrics.jsonl", "rollouts.jsonl"):
            shutil.copy(run_dir / log, cut / log)
        _train(src, _config(models[model], cut, sections), out / f"{name}-cut.yaml", nproc,
               "--set", "train.resume=latest")
    return run_dir


def _pinned(src: Path, name: str, sections: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``sections`` plus the ``PINNED`` settings of run ``name`` that the tree ``src`` knows (asked of its
    own config dataclasses: a key it does not have would be refused by its strict loader)."""
    out = {k: dict(v) for k, v in sections.items()}
    for section, values in PINNED.get(name, {}).items():
        for key, value in values.items():
            probe = ("import sys; from rallyrl.config import Config; "
                     f"sys.exit(0 if hasattr(Config.__dataclass_fields__[{section!r}].default_factory(), {key!r}) else 1)")
            if subprocess.run([sys.executable, "-c", probe], cwd=src, env=_env(src), capture_output=True).returncode == 0:
                out.setdefault(section, {})[key] = value
    return out


def _jsonl(path: Path) -> list[dict[str, Any]]:
    from rallyrl.run.logs import read_jsonl

    return read_jsonl(path)


def record(run_dir: Path) -> dict[str, Any]:
    """What must not change: final weights (sha256 of each tensor), metrics, rollouts."""
    import torch
    from safetensors.torch import load_file

    weights = {}
    for f in sorted((run_dir / "final").glob("*.safetensors")):
        for k, t in sorted(load_file(f).items()):
            raw = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            weights[f"{f.name}:{k}"] = hashlib.sha256(raw).hexdigest()
    metrics = [{k: v for k, v in m.items() if not k.startswith(VOLATILE) and not (k in ADDED and v == ADDED[k])}
               for m in _jsonl(run_dir / "metrics.jsonl")]
    return {"weights": weights, "metrics": metrics, "rollouts": _jsonl(run_dir / "rollouts.jsonl")}


def differences(a: Any, b: Any, where: str = "", limit: int = 10) -> list[str]:
    """The first ``limit`` places where two records differ (exact comparison, floats included)."""
    out: list[str] = []

    def walk(x: Any, y: Any, at: str) -> None:
        if len(out) >= limit:
            return
        if isinstance(x, dict) and isinstance(y, dict):
            for k in sorted(set(x) | set(y), key=str):
                if k not in x or k not in y:
                    out.append(f"{at}.{k}: only {'after' if k in y else 'before'}")
                else:
                    walk(x[k], y[k], f"{at}.{k}")
        elif isinstance(x, list) and isinstance(y, list):
            if len(x) != len(y):
                out.append(f"{at}: {len(x)} entries before, {len(y)} after")
            for i, (u, v) in enumerate(zip(x, y)):
                walk(u, v, f"{at}[{i}]")
        elif x != y:
            out.append(f"{at}: {x!r} before, {y!r} after")

    walk(a, b, where)
    return out


def compare(before: Path, after: Path, runs: list[str], work: Path) -> dict[str, list[str]]:
    """Run ``runs`` from both trees; returns, per run, the differences found (empty = identical)."""
    models = build_models(work / "models")
    result: dict[str, list[str]] = {}
    for name in runs:
        recs = []
        for side, src in (("before", before), ("after", after)):
            run_dir = make_run(src, name, models, work / side)
            recs.append(record(run_dir))
            if name == "resume":  # the resumed run equals its own uninterrupted run, on each side
                cut = record(work / side / f"{name}-cut")
                diff = differences(recs[-1], cut, f"{side}: uninterrupted vs resumed")
                result.setdefault(name, []).extend(diff)
        result.setdefault(name, []).extend(differences(recs[0], recs[1], name))
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", default=BASE, help=f"commit of the 'before' runs (default {BASE})")
    ap.add_argument("--after", default=None, help="commit of the 'after' runs (default: this working tree)")
    ap.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {','.join(RUNS)}")
    ap.add_argument("--keep", default=None, help="keep the run directories here (default: a temporary folder)")
    a = ap.parse_args(argv)
    runs = [r for r in a.runs.split(",") if r]
    unknown = [r for r in runs if r not in RUNS]
    if unknown:
        ap.error(f"unknown run(s) {unknown}; known: {list(RUNS)}")
    work = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="rallyrl-identity-"))
    try:
        before = export(a.before, work / "src-before")
        after = export(a.after, work / "src-after") if a.after else ROOT
        result = compare(before, after, runs, work)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    for name, diff in result.items():
        print(f"{name:8s} {'identical' if not diff else 'DIFFERENT'}")
        for d in diff:
            print(f"    {d}")
    return 0 if not any(result.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
