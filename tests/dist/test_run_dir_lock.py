"""One run, one writer: while a job trains in a run directory, a second `rallyrl train` on it (fresh,
`train.overwrite=true`, `train.resume: auto` or `latest`) and `rallyrl check` are refused at once, with
one line naming the holder and exit code 2, before anything is touched; a SIGKILLed holder is no
obstacle to the next start. After `kill -9` of the launcher alone, the refusal names the live rank 0
(issue 28 item 7: it named the dead launcher)."""

import os
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

from tests.helpers.runs import ROOT, base_config, env, rallyrl_train, write_config

pytestmark = pytest.mark.dist


def _wait_for(pred, timeout: float, what: str, proc) -> None:
    t0 = time.monotonic()
    while not pred():
        assert proc.poll() is None, f"the first job ended early: {proc.communicate()[1][-3000:]}"
        assert time.monotonic() - t0 < timeout, f"timed out waiting for {what}"
        time.sleep(0.1)


def _snapshot(run_dir):
    return {p.relative_to(run_dir): p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()}


def test_a_second_job_is_refused_and_a_killed_holder_is_no_obstacle(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    cfg = base_config(tiny_model, run_dir, train={"iterations": 500, "resume": "auto"},
                      checkpoint={"interval": 1}, reward={"fn": "tests.helpers.rewards:slow_hashed"})
    path = write_config(tmp_path / "c.yaml", cfg)
    first = subprocess.Popen([sys.executable, "-m", "rallyrl.cli", "train", str(path), "--nproc", "2"], cwd=ROOT,
                             env=env(RALLYRL_TEST_SLEEP="1.0"), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)
    procs: list[psutil.Process] = []
    try:
        _wait_for(lambda: (run_dir / "checkpoints" / "step_1").is_dir(), 240, "checkpoint step_1", first)
        holder = f"is in use by pid {first.pid} on host {socket.gethostname()} since "
        fresh = ["--set", "train.resume=null"]
        # auto/auto, fresh/fresh, fresh/overwrite, latest
        for extra in ([], fresh, [*fresh, "--set", "train.overwrite=true"], ["--set", "train.resume=latest"]):
            before = _snapshot(run_dir)
            second = rallyrl_train(path, 2, *extra, timeout=120)
            assert second.returncode == 2, (extra, second.stderr[-3000:])
            lines = second.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith(f"rallyrl: error: train.run_dir {run_dir} {holder}"), \
                (extra, second.stderr)
            assert str(path) in lines[0]  # the holder's command
            # nothing of the first job's was removed or rewritten by the second (it may have added files)
            after = _snapshot(run_dir)
            assert all(after.get(k) == v for k, v in before.items() if k.parts[0] != "checkpoints"
                       and k.name not in ("metrics.jsonl", "rollouts.jsonl", "rallyrl-run.json")), extra
        one = subprocess.run([sys.executable, "-m", "rallyrl.cli", "train", str(path)], cwd=ROOT, env=env(),
                             capture_output=True, text=True, timeout=120)  # one process, no launcher
        check = subprocess.run([sys.executable, "-m", "rallyrl.cli", "check", str(path)], cwd=ROOT, env=env(),
                               capture_output=True, text=True, timeout=120)
        for proc in (one, check):
            assert proc.returncode == 2 and holder in proc.stderr, proc.stderr[-3000:]
            assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert first.poll() is None  # the first job trains on

        # kill -9 the launcher alone; its ranks are paused first, so that they are still there to hold the
        # lock when the next start looks (left alone they would finish the iteration, checkpoint and exit)
        procs = psutil.Process(first.pid).children(recursive=True)
        rank0 = next(p for p in procs if p.environ().get("RANK") == "0")
        for p in procs:
            p.suspend()
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=30)  # reaped, as the shell that started it would
        second = rallyrl_train(path, 2, timeout=120)
        lines = second.stderr.strip().splitlines()
        assert second.returncode == 2 and len(lines) == 1, second.stderr[-3000:]
        assert f"is in use by pid {rank0.pid} on host {socket.gethostname()} since " in lines[0], lines
        assert f"rank 0 of a job whose launcher, pid {first.pid}, is gone" in lines[0], lines

        # SIGKILL every process of the first job (the ranks, without their launcher): the kernel drops the lock
        for p in procs:
            os.kill(p.pid, signal.SIGKILL)
        psutil.wait_procs(procs, timeout=30)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
        for p in procs:  # a failed assertion leaves none of them behind
            if p.is_running():
                p.kill()
    newest = max(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step_"))
    resumed = rallyrl_train(path, 2, "--set", f"train.iterations={newest + 1}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr
