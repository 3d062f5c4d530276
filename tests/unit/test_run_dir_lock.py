"""The run-directory lock (``run.lock.RunDirLock``) in one process, with no model (ms). A flock belongs to
an open file, so a second acquire in the same process conflicts exactly like a second job; the
multi-process paths (the launcher's hand-over, a SIGKILLed holder) are in tests/dist/test_run_dir_lock.py."""

from __future__ import annotations

import errno
import json
import os
import socket

import pytest

from rallyrl.cli import main
from rallyrl.config import load_config
from rallyrl.run import lock as run_lock
from rallyrl.run.lock import LOCK_FD_ENV, LOCK_FILE, RunDirBusyError, RunDirError, RunDirLock, holding_run_dir_locks
from rallyrl.run.rundir import RunDir


def _cfg(run_dir, **train):
    return load_config({"train": {"run_dir": str(run_dir), **train}})


def test_the_lock_records_its_holder_and_refuses_a_second_taker_at_once(tmp_path):
    run = tmp_path / "a" / "run"
    first = RunDirLock.acquire(run)
    try:
        info = json.loads((run / LOCK_FILE).read_text())
        assert info["pid"] == os.getpid() and info["host"] == socket.gethostname()
        assert info["since"].endswith(" UTC") and info["command"]
        with pytest.raises(RunDirBusyError) as e:
            RunDirLock.acquire(run)
        assert str(e.value).startswith(f"train.run_dir {run} is in use by pid {os.getpid()} on host "
                                       f"{socket.gethostname()} since {info['since']} (")
        assert "\n" not in str(e.value)
    finally:
        first.release()
    RunDirLock.acquire(run).release()  # released: free again (the file staying behind means nothing)


def test_a_run_dir_lock_is_held_for_the_block_and_taken_once_per_process(tmp_path):
    run = tmp_path / "run"
    cfg = _cfg(run)
    with holding_run_dir_locks() as held:
        RunDir.lock(run, cfg, create=False)
        assert held == [] and not run.exists()  # create=False: a folder that does not exist is not made
        RunDir.check_start(run, cfg, [], lock=True)
        RunDir.lock(run, cfg)  # the same process holds it already: no conflict with itself
        assert len(held) == 1
        with pytest.raises(RunDirBusyError):
            RunDirLock.acquire(run)
    RunDirLock.acquire(run).release()


def test_lock_run_dir_false_takes_no_lock(tmp_path):
    with holding_run_dir_locks() as held:
        RunDir.check_start(tmp_path / "run", _cfg(tmp_path / "run", lock_run_dir=False), [], lock=True)
        assert held == [] and not (tmp_path / "run" / LOCK_FILE).exists()


def test_only_the_main_rank_locks(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    with holding_run_dir_locks() as held:
        RunDir.lock(tmp_path / "run", _cfg(tmp_path / "run"))
        assert held == []


def test_the_main_rank_adopts_its_launchers_lock(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    launcher = RunDirLock.acquire(run)
    inherited = os.dup(launcher.fd)  # what pass_fds gives the worker: the same open file, so the same lock
    monkeypatch.setenv(LOCK_FD_ENV, f"{inherited}:{run / LOCK_FILE}")
    adopted = RunDirLock.acquire(run)
    assert adopted.fd == inherited and LOCK_FD_ENV not in os.environ  # taken over once
    launcher.release()
    with pytest.raises(RunDirBusyError) as e:  # the worker's copy keeps it held after the launcher let go
        RunDirLock.acquire(run)
    adopted.release()
    RunDirLock.acquire(run).release()
    # the lock file names the launcher (here: alive, this very process) and its rank 0
    assert f"is in use by pid {os.getpid()} on host " in str(e.value)
    assert f"; its rank 0 is pid {os.getpid()})" in str(e.value)


def test_a_dead_launchers_lock_names_its_live_rank_0(tmp_path, monkeypatch):
    """``kill -9`` of the launcher: its workers live on (they finish the iteration and checkpoint) and
    hold the lock; the refusal names rank 0, which can be waited for or stopped, not the dead pid."""
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # reaped: no such process any more
    run = tmp_path / "run"
    run.mkdir()
    launcher = RunDirLock.acquire(run)
    info = json.loads((run / LOCK_FILE).read_text())
    (run / LOCK_FILE).write_text(json.dumps({**info, "pid": dead.pid}))  # as the launcher wrote it
    monkeypatch.setenv(LOCK_FD_ENV, f"{os.dup(launcher.fd)}:{run / LOCK_FILE}")
    adopted = RunDirLock.acquire(run)
    launcher.release()
    info = json.loads((run / LOCK_FILE).read_text())
    assert info["pid"] == os.getpid() and info["launcher"] == dead.pid
    with pytest.raises(RunDirBusyError) as e:
        RunDirLock.acquire(run)
    adopted.release()
    assert str(e.value).startswith(f"train.run_dir {run} is in use by pid {os.getpid()} on host ")
    assert f"rank 0 of a job whose launcher, pid {dead.pid}, is gone: its workers are stopping)" in str(e.value)
    assert str(e.value).endswith("wait for that job to end (or stop it), or choose another train.run_dir")


def test_a_failed_start_leaves_no_trace_and_a_used_run_dir_keeps_its_lock_file(tmp_path):
    run = tmp_path / "new" / "run"
    RunDirLock.acquire(run).release()  # nothing else was written: the folders it created go again
    assert not (tmp_path / "new").exists()
    lock = RunDirLock.acquire(run)
    (run / "config.yaml").write_text("x")
    lock.release()
    assert sorted(p.name for p in run.iterdir()) == [LOCK_FILE, "config.yaml"]


def test_a_lock_file_removed_between_open_and_flock_is_taken_again(tmp_path, monkeypatch):
    """The race of a holder that removes its lock file on release: the taker must not end up holding a
    lock on a file nobody else can see."""
    run = tmp_path / "run"
    run.mkdir()
    real_flock, calls = run_lock.fcntl.flock, []

    def flock_after_unlink(fd, op):
        calls.append(op)
        if len(calls) == 1:
            (run / LOCK_FILE).unlink()  # the previous holder's release, right between open and flock
        return real_flock(fd, op)

    monkeypatch.setattr(run_lock.fcntl, "flock", flock_after_unlink)
    lock = RunDirLock.acquire(run)
    assert len(calls) == 2 and os.path.samestat(os.fstat(lock.fd), os.stat(run / LOCK_FILE))
    lock.release()


@pytest.mark.parametrize("code", [errno.ENOLCK, errno.EOPNOTSUPP])
def test_a_file_system_without_locks_is_a_clear_error(tmp_path, monkeypatch, code):
    def no_locks(fd, op):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(run_lock.fcntl, "flock", no_locks)
    with pytest.raises(RunDirError, match=r"without working file locks .*train.lock_run_dir=false"):
        RunDirLock.acquire(tmp_path / "run")


def test_check_on_a_run_dir_in_use_is_one_line_exit_2(tmp_path, capsys):
    run = tmp_path / "run"
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(f"train:\n  run_dir: {run}\n")
    held = RunDirLock.acquire(run)
    try:
        for cmd in ("check", "train"):
            assert main([cmd, str(cfg_path)]) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and err.startswith(f"rallyrl: error: train.run_dir {run} is in use by pid "), err
    finally:
        held.release()


def test_a_second_job_is_refused_before_torch_is_even_imported(tmp_path):
    """"At once": the refusal comes before the inputs are read and before torch/transformers are imported
    (seconds), for one process and for the --nproc launcher alike."""
    import subprocess
    import sys

    from tests.helpers.runs import ROOT, env

    run = tmp_path / "run"
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(f"train:\n  run_dir: {run}\n")
    held = RunDirLock.acquire(run)
    try:
        for extra in ([], ["--nproc", "2"]):
            code = ("import sys; from rallyrl.cli import main; rc = main(['train', sys.argv[1], *sys.argv[2:]]); "
                    "print(rc, sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
            out = subprocess.run([sys.executable, "-c", code, str(cfg_path), *extra], cwd=ROOT, env=env(),
                                 capture_output=True, text=True, timeout=120)
            assert out.stdout.strip() == "2 []", (extra, out.stdout, out.stderr)
            assert f"is in use by pid {os.getpid()}" in out.stderr
    finally:
        held.release()
