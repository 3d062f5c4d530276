"""One run, one writer: the run-directory lock (``RunDirLock``) and how long it is held.

The main rank takes an exclusive ``flock`` on ``run_dir/.lock`` before anything is read or written, and
holds it for the whole run; ``rallyrl train --nproc N`` takes it in the launcher and hands the
descriptor to the main rank (``LOCK_FD_ENV``), so it stays held while either lives. A second job on the
same folder is refused at once, naming the holder. No torch here: the CLI takes the lock before it
imports anything heavy, so a refusal is instant.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import functools
import json
import os
import shlex
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .. import dist
from ..config import ConfigError
from ..errors import writing
# `rallyrl train --nproc N`: the launcher takes the lock and hands its file descriptor to the main rank,
# so the lock stays held while that rank lives even if the launcher is killed.
from ..launch import LOCK_FD_ENV

__all__ = ["LOCK_FD_ENV", "LOCK_FILE", "RunDirBusyError", "RunDirError", "RunDirLock", "holding_run_dir_locks",
           "lock_run_dir", "releases_run_dir_lock"]


class RunDirError(ConfigError):
    """The run directory cannot be used as asked (a user error: reported like a config error)."""


class RunDirBusyError(RunDirError):
    """Another job holds the run directory's lock: it is training (or checking) there right now."""


LOCK_FILE = ".lock"
# flock's errors on a file system that has no working locks (NFS without lockd, Lustre without -o flock)
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


class RunDirLock:
    """An exclusive ``flock`` on ``run_dir/.lock``, held by the main rank for the whole run.

    The kernel releases a ``flock`` when the last descriptor of its open file is closed, the holder's
    death included (SIGKILL, the OOM killer): a crashed run never leaves a stale lock, and the file
    staying behind means nothing by itself. While held, the file records who holds it (host, pid, start
    time, command) for the error a second job gets. ``flock`` is advisory: only rallyrl processes honour
    it, which is what it is for."""

    def __init__(self, path: Path, fd: int, created: list[Path] | None = None) -> None:
        self.path, self.fd = path, fd
        self.created = created or []  # folders that did not exist before this lock (innermost first)

    @staticmethod
    def acquire(run_dir: Path, create: bool = True) -> "RunDirLock | None":
        """Take the lock of ``run_dir`` (creating the folder and the lock file), or raise
        ``RunDirBusyError`` naming the holder, at once (never waits). ``create=False`` (``rallyrl
        check``): a folder that does not exist, or cannot be written, has nothing to protect: None."""
        run_dir = Path(run_dir)
        if run_dir.exists() and not run_dir.is_dir():
            return None  # check_start refuses it with its own line
        path = run_dir / LOCK_FILE
        inherited = RunDirLock._inherited(path)
        if inherited is not None:
            return inherited
        if not create and not run_dir.is_dir():
            return None
        # The folders this lock creates: a start that fails before writing anything else (a bad resume
        # choice, a model that does not load) removes them again on release, leaving no trace.
        created = [p for p in (run_dir, *run_dir.parents) if not p.exists()]
        for _ in range(10):
            fd = RunDirLock._take(run_dir, path, create)
            if fd is None:
                return None
            # The lock file may have been removed (``release``) between our open and our flock, by a
            # holder that then let go: we would hold a lock on a file nobody else can see. Start again.
            try:
                if os.path.samestat(os.fstat(fd), os.stat(path)):
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        else:
            raise RunDirError(f"train.run_dir {run_dir}: could not take the lock on {path} (it kept being removed)")
        lock = RunDirLock(path, fd, created)
        lock._write_holder()
        return lock

    def _write_holder(self) -> None:
        """Record who holds the lock (host, pid, start time, command) for the error a second job gets."""
        since = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        info = {"host": socket.gethostname(), "pid": os.getpid(), "since": since, "command": _command()}
        with writing(self.path, "locking train.run_dir"):
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, (json.dumps(info) + "\n").encode(), 0)

    @staticmethod
    def _take(run_dir: Path, path: Path, create: bool) -> int | None:
        """Open ``path`` and flock it (non-blocking): the descriptor, None (``create=False`` and the folder
        cannot be written), or ``RunDirBusyError`` / ``RunDirError`` (no working locks)."""
        try:
            with writing(run_dir, "locking train.run_dir"):
                run_dir.mkdir(parents=True, exist_ok=True)
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except Exception:
            if create:
                raise
            return None  # a read-only check of a folder this user cannot write
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RunDirBusyError(f"train.run_dir {run_dir} is in use by {RunDirLock._holder(path)}: wait for that "
                                  f"job to end (or stop it), or choose another train.run_dir") from None
        except OSError as e:
            os.close(fd)
            if e.errno not in _NO_LOCKS:
                raise
            raise RunDirError(
                f"train.run_dir {run_dir} is on a file system without working file locks (flock: {e.strerror}): "
                f"rallyrl cannot make sure one job at a time writes there. Use a file system with locks (a "
                f"local disk; NFS with its lock service), or set train.lock_run_dir=false and make sure of "
                f"it yourself") from None
        return fd

    @staticmethod
    def _inherited(path: Path) -> "RunDirLock | None":
        """The lock this process's launcher took for ``path`` and passed down (``LOCK_FD_ENV``), once."""
        value = os.environ.get(LOCK_FD_ENV, "")
        fd_text = value.partition(":")[0]
        if not fd_text.isdigit():
            return None
        fd = int(fd_text)
        try:  # the descriptor must be open on this very file (same device and inode)
            st, want = os.fstat(fd), os.stat(path)
        except OSError:
            return None
        if (st.st_dev, st.st_ino) != (want.st_dev, want.st_ino):
            return None
        os.environ.pop(LOCK_FD_ENV)
        os.set_inheritable(fd, False)  # not into a reward server this rank may start
        lock = RunDirLock(path, fd)
        lock._adopted()
        return lock

    def _adopted(self) -> None:
        """The main rank took over its launcher's lock: the file now names this process as the holder and
        the launcher beside it. A launcher killed with SIGKILL leaves its workers running (they finish
        the iteration and checkpoint), and the job to wait for, or stop, is then this process."""
        with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
            info = json.loads(os.pread(self.fd, 1 << 16, 0).decode("utf-8"))
            info = {**info, "pid": os.getpid(), "launcher": info["pid"]}
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, (json.dumps(info) + "\n").encode(), 0)

    @staticmethod
    def _holder(path: Path) -> str:
        """"pid P on host H since T (command)" from the lock file; the holder writes it right after it
        took the lock, so an empty file is given a moment. A job started by ``--nproc``: the launcher's
        pid and its rank 0's, or rank 0 alone once the launcher is gone (killed with SIGKILL)."""
        for _ in range(20):
            try:
                info = json.loads(path.read_text(encoding="utf-8"))
                return _describe_holder(info["pid"], info["host"], info["since"], info["command"],
                                        info.get("launcher"))
            except (OSError, ValueError, KeyError, TypeError):
                time.sleep(0.05)
        return "another process (it has not written its pid, host and start time yet)"

    def release(self) -> None:
        """Close this process's descriptor: the kernel drops the lock once no process holds it (a launcher
        and its main rank share one). If this lock created the run directory and nothing but the lock
        file is in it (the start failed before writing anything), the file and the folders go first,
        while the lock is still held (a concurrent taker notices, see ``acquire``)."""
        if self.fd < 0:
            return
        run_dir = self.path.parent
        if self.created and run_dir.is_dir() and [p.name for p in run_dir.iterdir()] == [LOCK_FILE]:
            with contextlib.suppress(OSError):
                self.path.unlink()
                for folder in self.created:
                    folder.rmdir()  # only empty ones: stops at the first folder that holds anything
        os.close(self.fd)
        self.fd = -1


def _describe_holder(pid: int, host: str, since: str, command: str, launcher: int | None) -> str:
    if launcher is None:
        return f"pid {pid} on host {host} since {since} ({command})"
    if host != socket.gethostname() or _alive(launcher):
        return f"pid {launcher} on host {host} since {since} ({command}; its rank 0 is pid {pid})"
    return (f"pid {pid} on host {host} since {since} ({command}; rank 0 of a job whose launcher, pid {launcher}, "
            f"is gone: its workers are stopping)")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    return True


def _command() -> str:
    """This process's command line as the user typed it: ``rallyrl train c.yaml`` rather than the path
    of ``rallyrl/cli.py`` that ``python -m rallyrl.cli`` (a launcher's worker, a test) leaves in argv."""
    argv = list(sys.argv)
    if argv and Path(argv[0]).name in ("rallyrl", "cli.py", "__main__.py"):
        argv[0] = "rallyrl"
    return shlex.join(argv)


_held_locks: list[RunDirLock] = []  # taken inside the innermost ``holding_run_dir_locks`` block


@contextlib.contextmanager
def holding_run_dir_locks() -> Iterator[list[RunDirLock]]:
    """Run-directory locks taken inside the block (``RunDir.check_start(lock=True)``) are released when
    it ends, however it ends. Yields the list of those locks."""
    depth = len(_held_locks)
    try:
        yield _held_locks
    finally:
        while len(_held_locks) > depth:
            _held_locks.pop().release()


def releases_run_dir_lock(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator (``train()``): the run-directory lock it takes is released when it returns or raises."""

    @functools.wraps(fn)
    def inner(*args: Any, **kwargs: Any) -> Any:
        with holding_run_dir_locks():
            return fn(*args, **kwargs)

    return inner


def lock_run_dir(path: Path, enabled: bool, create: bool = True) -> None:
    """Take ``path``'s lock now (main rank; a no-op when this process already holds it or ``enabled``,
    ``train.lock_run_dir``, is false), held until the enclosing ``holding_run_dir_locks`` block ends.
    ``create=False``: only if the folder exists (a job already running there is refused before the
    inputs are read; a new folder is created only once the inputs are known to be good)."""
    if not enabled or dist.expected_rank() != 0:
        return
    lock_file = Path(path) / LOCK_FILE
    for held in _held_locks:
        with contextlib.suppress(OSError):
            if lock_file.exists() and os.path.samefile(held.path, lock_file):
                return
    got = RunDirLock.acquire(Path(path), create=create)
    if got is not None:
        _held_locks.append(got)
