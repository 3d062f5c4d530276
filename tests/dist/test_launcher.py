"""`rallyrl train --nproc 2` as a job scheduler and a newcomer meet it: signals sent to the launching
process alone stop every worker, and a failure in a worker is one line, once, from the launcher."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.helpers.runs import ROOT, base_config, env, rallyrl_train, write_config

pytestmark = pytest.mark.dist


def _wait_for(pred, timeout: float, what: str) -> None:
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_the_launcher_alone_stops_every_worker(tiny_model, tmp_path, sig):
    run_dir = tmp_path / "run"
    cfg = base_config(tiny_model, run_dir, train={"iterations": 500})  # far longer than the test
    path = write_config(tmp_path / "c.yaml", cfg)
    # The launcher in a session of its own, as a scheduler starts it: the signal reaches it alone.
    launcher = subprocess.Popen([sys.executable, "-m", "rallyrl.cli", "train", str(path), "--nproc", "2"],
                                cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    try:
        metrics = run_dir / "metrics.jsonl"
        _wait_for(lambda: metrics.is_file() and metrics.read_text().count("\n") >= 1, 180, "iteration 1")
        workers = psutil.Process(launcher.pid).children(recursive=True)
        assert len(workers) >= 2, workers
        os.kill(launcher.pid, sig)
        out, err = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 128 + sig, err[-3000:]
    survivors = [p for p in workers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert survivors == [], survivors
    assert "Traceback" not in err, err[-3000:]
    steps = metrics.read_text().count("\n")
    time.sleep(1.0)
    assert metrics.read_text().count("\n") == steps  # nobody logs on in the background


def test_a_config_error_in_the_workers_is_one_message_and_exit_2(tiny_model, tmp_path):
    # The run dir check runs in the workers (it needs the run dir as the trainer finds it): the
    # second run into the same folder fails there, on both ranks.
    cfg = base_config(tiny_model, tmp_path / "run", train={"iterations": 1}, rollout={"num_rollouts": 4})
    path = write_config(tmp_path / "c.yaml", cfg)
    first = rallyrl_train(path, 2)
    assert first.returncode == 0, first.stderr[-3000:]
    files = sorted(p.relative_to(tmp_path) for p in (tmp_path / "run").rglob("*"))
    second = rallyrl_train(path, 2)
    assert second.returncode == 2, second.stderr[-3000:]
    lines = [ln for ln in second.stderr.splitlines() if ln.startswith("rallyrl: error: ")]
    assert len(lines) == 1 and "already holds a run" in lines[0], second.stderr
    assert "Traceback" not in second.stderr and "ChildFailedError" not in second.stderr, second.stderr
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "run").rglob("*")) == files


def test_a_batch_plan_error_for_n_processes_stops_before_any_worker(tiny_model, tmp_path):
    # 5 rollouts over 2 processes: the smallest per-rank batch is 2, too small for 3 minibatches.
    cfg = base_config(tiny_model, tmp_path / "run", rollout={"num_rollouts": 5}, ppo={"num_minibatches": 3})
    proc = rallyrl_train(write_config(tmp_path / "c.yaml", cfg), 2, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "rallyrl: error: ppo.num_minibatches=3 exceeds the smallest per-rank batch (2 = rollout.num_rollouts 5 "
        "split over 2 processes); every rank must take the same number of optimizer steps"]
    assert not (tmp_path / "run").exists()
