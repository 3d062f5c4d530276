"""Helpers to write configs and launch real multi-process runs (gloo on CPU)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def base_config(model: Path, run_dir: Path, **sections) -> dict:
    cfg = {
        "model": {"path": str(model)},
        "data": {"prompts": ["the cat", "a dog", "good morning", "what a", "i like", "the sun", "we walk",
                             "birds sing", "my friend", "the rain"]},
        "train": {"run_dir": str(run_dir), "iterations": 2, "seed": 3, "progress": False, "num_threads": 1},
        "rollout": {"num_rollouts": 7, "chunk_size": 2},
        "generation": {"max_new_tokens": 6},
        "ppo": {"epochs": 2, "num_minibatches": 2, "lr": 1e-3},
        "reward": {"fn": "tests.helpers.rewards:hashed"},
    }
    for k, v in sections.items():
        cfg.setdefault(k, {}).update(v)
    return cfg


def killed_run_copy(run_dir: Path, dest: Path, step: int) -> Path:
    """``dest`` as a run killed after checkpoint ``step`` of ``run_dir`` would leave it: that one
    checkpoint and the whole run's logs (iterations after the checkpoint logged, never checkpointed)."""
    (dest / "checkpoints").mkdir(parents=True)
    shutil.copytree(run_dir / "checkpoints" / f"step_{step}", dest / "checkpoints" / f"step_{step}")
    for name in ("metrics.jsonl", "rollouts.jsonl"):
        shutil.copy(run_dir / name, dest / name)
    return dest


def write_config(path: Path, cfg: dict) -> Path:
    path.write_text(yaml.safe_dump(cfg))
    return path


def env(**extra: str) -> dict[str, str]:
    e = dict(os.environ)
    e.update({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
              "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")})
    e.update(extra)
    return e


def rallyrl_train(config: Path, nproc: int, *extra_args: str, timeout: float = 240, **env_extra: str):
    """`rallyrl train CONFIG --nproc N` as a user runs it; returns the CompletedProcess."""
    cmd = [sys.executable, "-m", "rallyrl.cli", "train", str(config), "--nproc", str(nproc), *extra_args]
    return subprocess.run(cmd, cwd=ROOT, env=env(**env_extra), capture_output=True, text=True, timeout=timeout)


def kill_when_paused(config: Path, nproc: int, counter: Path, pause_at: int, timeout: float = 240):
    """Start ``rallyrl train CONFIG --nproc N`` whose reward (``tests.helpers.rewards``, through
    RALLYRL_TEST_PAUSE_AT / RALLYRL_TEST_COUNTER) pauses in call ``pause_at``; once it pauses, SIGKILL
    every process of the run (CLI, launcher, ranks). Returns the command and environment that resume it."""
    import time

    cmd = [sys.executable, "-m", "rallyrl.cli", "train", str(config), "--nproc", str(nproc)]
    e = env(RALLYRL_TEST_PAUSE_AT=str(pause_at), RALLYRL_TEST_COUNTER=str(counter))
    victim = subprocess.Popen(cmd, cwd=ROOT, env=e, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout
    while not Path(f"{counter}.paused").exists():
        assert victim.poll() is None and time.monotonic() < deadline, "run ended before the kill point"
        time.sleep(0.2)
    subprocess.run(["pkill", "-KILL", "-f", str(config)], check=True)  # every process started for this run
    assert victim.wait(timeout=30) == -9
    return cmd, e


def resume_latest(cmd: list[str], e: dict[str, str], timeout: float = 240) -> subprocess.CompletedProcess:
    """Resume the run that ``kill_when_paused`` killed, from its newest checkpoint; it must succeed."""
    resumed = subprocess.run(cmd + ["--set", "train.resume=latest"], cwd=ROOT, env=e, capture_output=True,
                             text=True, timeout=timeout)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr
    return resumed
