"""The run directory: its lifecycle (``RunDir``) and its writers (``RunWriter``, the ``Tracker`` objects).

``RunDir`` owns every decision about the folder: may a run start here, is it a resume, which checkpoint,
what may be removed, what the logs keep after a resume. rallyrl records every file and folder it
creates in ``rallyrl-run.json`` (the manifest) and only ever removes or replaces what is listed there:
``train.overwrite=true`` removes exactly rallyrl's own outputs, and a file of the user's under one of
rallyrl's output names is never replaced (the run refuses, naming it).

Only the main rank writes (one writer per file, so lines never interleave). Files are opened in append
mode and flushed per line, so a killed run keeps every completed iteration. ``metrics.jsonl`` is strict
JSON: a non-finite value is written as ``null``.

Metrics go to trackers behind one small protocol (``Tracker``: ``start(config)``, ``log(step, metrics)``,
``close()``): ``metrics.jsonl`` is always one; ``train.report_to`` adds TensorBoard, W&B, MLflow or
Trackio (``rallyrl.trackers``, each imported only when chosen).
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import functools
import json
import math
import os
import shlex
import shutil
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import yaml

from . import dist
from . import trackers
from .callbacks import Callbacks
from .config import (CheckpointConfig, Change, Config, ConfigError, TrainConfig, config_changes, config_warnings,
                     flat_config, format_changes)
from .errors import CheckpointError, Preempted, TrackerError, requested_stop, writing
# `rallyrl train --nproc N`: the launcher takes the lock and hands its file descriptor to the main rank,
# so the lock stays held while that rank lives even if the launcher is killed.
from .launch import LOCK_FD_ENV

if TYPE_CHECKING:
    from .rollout import Rollouts

MANIFEST = "rallyrl-run.json"
# Everything rallyrl may write at the top of a run directory; folders marked True hold only rallyrl's files.
OUTPUTS = {"config.yaml": False, "config_history.jsonl": False, "metrics.jsonl": False, "rollouts.jsonl": False,
           "eval": False, "checkpoints": True, "final": True, "tensorboard": True, trackers.STATE_FILE: False}


class RunDirError(ConfigError):
    """The run directory cannot be used as asked (a user error: reported like a config error)."""


class RunDirBusyError(RunDirError):
    """Another job holds the run directory's lock: it is training (or checking) there right now."""


# --------------------------------------------------------------------------------------------------
# One run, one writer: the run-directory lock

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
        since = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        info = {"host": socket.gethostname(), "pid": os.getpid(), "since": since, "command": _command()}
        with writing(path, "locking train.run_dir"):
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        return lock

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
        return RunDirLock(path, fd)

    @staticmethod
    def _holder(path: Path) -> str:
        """"pid P on host H since T (command)" from the lock file; the holder writes it right after it
        took the lock, so an empty file is given a moment."""
        for _ in range(20):
            try:
                info = json.loads(path.read_text(encoding="utf-8"))
                return f"pid {info['pid']} on host {info['host']} since {info['since']} ({info['command']})"
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


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None  # strict JSON has no NaN/inf: a non-finite value is written as null
    return v


class RunDir:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.resuming = False  # decided by check_start
        self.changes: list[Change] = []  # config changes against the recorded run (a resume)
        # The manifest, read from disk once and then kept here: only this object (on the main rank) writes
        # it, and every change is written through at once (see ``record``).
        self._manifest_cache: dict[str, list[str]] | None = None
        self.cfg: Config | None = None  # the run's config, once check_start has accepted it

    # --- what is there ---------------------------------------------------------------------------
    def _manifest(self) -> dict[str, list[str]]:
        if self._manifest_cache is None:
            self._manifest_cache = self._read_manifest()
        return self._manifest_cache

    def _read_manifest(self) -> dict[str, list[str]]:
        f = self.path / MANIFEST
        if not f.is_file():
            return {"files": [], "dirs": []}
        try:
            m = json.loads(f.read_text(encoding="utf-8"))
            return {"files": list(m.get("files", [])), "dirs": list(m.get("dirs", []))}
        except (json.JSONDecodeError, AttributeError, TypeError):
            raise RunDirError(f"{f} is corrupt; delete it only if nothing else in {self.path} is rallyrl's") from None

    def _owned(self, rel: str) -> bool:
        m = self._manifest()
        parts = Path(rel).parts
        return rel in m["files"] or any(parts[: len(Path(d).parts)] == Path(d).parts for d in m["dirs"])

    def holds_run(self) -> bool:
        """True if a run completed an iteration here or left a checkpoint (else the folder counts as empty)."""
        from .checkpoint import checkpoint_dir, list_checkpoints

        if list_checkpoints(checkpoint_dir(self.path)):
            return True
        metrics = self.path / "metrics.jsonl"
        if metrics.is_file():
            for line in metrics.read_text(encoding="utf-8").splitlines():
                try:
                    if line.strip() and json.loads(line).get("step", 0) >= 1:
                        return True
                except json.JSONDecodeError:
                    return True  # not ours to judge: treat as a run
        return False

    def newest_checkpoint(self) -> Path | None:
        from .checkpoint import checkpoint_dir, list_checkpoints

        steps = list_checkpoints(checkpoint_dir(self.path))
        return steps[-1] if steps else None

    # --- may a run start here? (every rank, before anything heavy) -------------------------------
    @staticmethod
    def check_start(path: Path, cfg: Config, eval_steps: list[int], lock: bool = False,
                    dry_run: bool = False) -> "RunDir":
        """The run directory, once it is decided whether this is a fresh start or a resume, with what
        would mix two runs, replace a user's file or silently change a resumed run refused (with the fix).
        Read-only: every rank (and the launcher, before any worker) may call it.

        ``lock``: first take the run directory's lock (``RunDirLock``; on the main rank only, and unless
        ``train.lock_run_dir`` is false), held until the enclosing ``holding_run_dir_locks`` block ends:
        a second job is refused before anything is read or written. ``dry_run`` (``rallyrl check``):
        the lock is taken only if the folder exists, and nothing is created."""
        if lock:
            RunDir.lock(Path(path), cfg, create=not dry_run)
        run_dir = RunDir(path)
        run_dir._check_start(cfg, eval_steps)
        run_dir.cfg = cfg  # for final/README.md
        return run_dir

    @staticmethod
    def lock(path: Path, cfg: Config, create: bool = True) -> None:
        """Take ``path``'s lock now (main rank; a no-op when this process already holds it or
        ``train.lock_run_dir`` is false), held until the enclosing ``holding_run_dir_locks`` block ends.
        ``create=False``: only if the folder exists (a job already running there is refused before the
        inputs are read; a new folder is created only once the inputs are known to be good)."""
        if not cfg.train.lock_run_dir or dist.expected_rank() != 0:
            return
        lock_file = Path(path) / LOCK_FILE
        for held in _held_locks:
            with contextlib.suppress(OSError):
                if lock_file.exists() and os.path.samefile(held.path, lock_file):
                    return
        got = RunDirLock.acquire(Path(path), create=create)
        if got is not None:
            _held_locks.append(got)

    def _check_start(self, cfg: Config, eval_steps: list[int]) -> None:
        train = cfg.train
        trackers.check_installed(cfg)  # a missing tracker package names its extra before anything starts
        self.resuming = train.resume not in (None, "auto") or (train.resume == "auto" and self.newest_checkpoint() is not None)
        if self.resuming:
            self._check_config_change(cfg)
            return
        if self.holds_run() and not train.overwrite:
            raise RunDirError(
                f"train.run_dir {self.path} already holds a run; resume it with train.resume=latest, start over "
                f"with train.overwrite=true (removes only rallyrl's own files), or choose another train.run_dir")
        if self.path.exists() and not self.path.is_dir():
            raise RunDirError(f"train.run_dir {self.path} is a file, not a folder")
        for rel in self._planned(eval_steps):
            p = self.path / rel
            if not p.exists() or self._owned(rel):
                continue
            if p.is_dir() and not any(p.iterdir()):
                continue  # an empty folder loses nothing
            raise RunDirError(
                f"train.run_dir {self.path} holds {p}, which rallyrl did not write and would replace; move it "
                f"or choose another train.run_dir")

    def recorded_config(self) -> dict[str, Any] | None:
        """The config the run has trained with so far: ``config.yaml`` as first written, plus every change
        a resume recorded in ``config_history.jsonl``. None if the folder has no ``config.yaml``."""
        path = self.path / "config.yaml"
        if not path.is_file():
            return None
        cfg = yaml.safe_load(path.read_text(encoding="utf-8-sig")) or {}
        history = self.path / "config_history.jsonl"
        if history.is_file():
            for line in history.read_text(encoding="utf-8").splitlines():
                for c in json.loads(line)["changes"] if line.strip() else []:
                    *parents, leaf = c["key"].split(".")
                    node = cfg
                    for k in parents:
                        node = node.setdefault(k, {})
                    node[leaf] = c["new"]
        return cfg

    def _check_config_change(self, cfg: Config) -> None:
        """Honest resume: a change to anything that alters training is refused, listed, unless allowed."""
        recorded = self.recorded_config()
        if recorded is None:
            return
        self.changes = config_changes(recorded, cfg.to_dict())
        needs = [c for c in self.changes if c.needs_permission]
        if needs and not cfg.train.allow_config_change:
            raise RunDirError(
                f"train.resume: the config differs from the one {self.path} was trained with, in settings "
                f"that alter training:\n{format_changes(needs)}\nresume with the recorded values, or allow "
                f"the change with --set train.allow_config_change=true (it then takes effect from the "
                f"resumed iteration on, and is recorded in config_history.jsonl)")

    def _planned(self, eval_steps: list[int]) -> list[str]:
        return [n for n in OUTPUTS if n != "eval"] + [f"eval/step_{s}.jsonl" for s in eval_steps]

    # --- start writing (collective) --------------------------------------------------------------
    def open(self, cfg: Config, resumed_from: Path | None, iteration: int,
             was_world_size: int | None = None) -> "RunWriter | None":
        """Main rank: a fresh start removes rallyrl's own earlier outputs and writes ``config.yaml``; a
        resume leaves ``config.yaml`` as first written and appends what changed, and at which iteration,
        to ``config_history.jsonl`` (a resume on another number of processes than ``was_world_size``, the
        checkpoint's, is recorded there too: from that iteration on the run is not bit-identical to an
        uninterrupted one). Then the trackers start (a failure there, e.g. a tracker server that cannot be
        reached, stops every rank with a ``TrackerError``). Returns the writer there (None elsewhere).
        Every rank waits here."""
        writer = None
        if dist.is_main():
            with writing(self.path, "starting the run"):
                writer = self._open(cfg, resumed_from, iteration, was_world_size)
        dist.barrier()

        def start_trackers() -> None:
            if writer is not None:
                try:
                    writer.start(cfg)
                except BaseException:
                    writer.close()
                    raise

        dist.agree(start_trackers, TrackerError, main_only=True, what="starting the trackers (train.report_to)")
        return writer

    def _open(self, cfg: Config, resumed_from: Path | None, iteration: int, was_world_size: int | None) -> "RunWriter":
        self.path.mkdir(parents=True, exist_ok=True)
        if resumed_from is None:
            self.clear_own()
            self.write_file("config.yaml", cfg.to_yaml())
        else:
            # Resuming says this folder holds the run: its outputs are rallyrl's (a run written before
            # the manifest existed, or a checkpoint copied elsewhere, is adopted here).
            for name, is_dir in OUTPUTS.items():
                if (self.path / name).exists():
                    self.record(name, is_dir or (self.path / name).is_dir())
            changes = self.changes
            if not (self.path / "config.yaml").exists():
                self.write_file("config.yaml", cfg.to_yaml())
                changes = []  # the config just written is the one in use
            resized = was_world_size is not None and was_world_size != dist.world_size()
            if changes or resized:
                row: dict[str, Any] = {"iteration": iteration, "checkpoint": str(resumed_from),
                                       "changes": [{"key": c.key, "old": c.old, "new": c.new} for c in changes]}
                if resized:
                    # Not a config key (recorded_config replays only "changes"): the process count is
                    # a launch setting, but the record must say where exactness ended.
                    row["world_size"] = {"old": was_world_size, "new": dist.world_size()}
                    row["bit_identical"] = False
                with open(self.claim("config_history.jsonl"), "a", encoding="utf-8") as f:
                    f.write(json.dumps(row) + "\n")
        return RunWriter(self, cfg, resuming=resumed_from is not None)

    def clear_own(self) -> None:
        """Remove exactly what the manifest lists (rallyrl's outputs), nothing else."""
        m = self._manifest()
        for rel in m["files"]:
            (self.path / rel).unlink(missing_ok=True)
        for rel in m["dirs"]:
            shutil.rmtree(self.path / rel, ignore_errors=True)
        eval_dir = self.path / "eval"
        if eval_dir.is_dir() and not any(eval_dir.iterdir()):
            eval_dir.rmdir()
        (self.path / MANIFEST).unlink(missing_ok=True)
        self._manifest_cache = {"files": [], "dirs": []}

    # --- recording what rallyrl writes (main rank) -----------------------------------------------
    def record(self, rel: str, is_dir: bool = False) -> None:
        """List ``rel`` as rallyrl's. The manifest on disk is rewritten (atomically: a temporary file, then
        ``os.replace``) before the caller creates ``rel``, so a crash at any point leaves a manifest that
        lists everything rallyrl wrote; nothing is written when ``rel`` is already listed."""
        m = self._manifest()
        key = "dirs" if is_dir else "files"
        if rel not in m[key]:
            updated = {**m, key: [*m[key], rel]}
            tmp = self.path / (MANIFEST + ".tmp")
            tmp.write_text(json.dumps(updated, indent=1), encoding="utf-8")
            os.replace(tmp, self.path / MANIFEST)
            self._manifest_cache = updated  # only once it is on disk: a failed write changes nothing here

    def claim(self, rel: str, is_dir: bool = False) -> Path:
        """The path of an output about to be written; refuses a file or folder rallyrl did not write."""
        p = self.path / rel
        if p.exists() and not self._owned(rel) and not (p.is_dir() and not any(p.iterdir())):
            raise RunDirError(f"{p} exists and was not written by rallyrl; refusing to replace it")
        if is_dir and not p.exists():
            p.mkdir(parents=True)
        self.record(rel, is_dir)
        return p

    def write_file(self, rel: str, text: str) -> None:
        self.claim(rel).write_text(text, encoding="utf-8")

    # --- resume ----------------------------------------------------------------------------------
    def resume_point(self, train: TrainConfig) -> Path | None:
        """The checkpoint to resume from (chosen on the main rank, so every rank loads the same one), or
        None for a fresh start."""
        if not self.resuming:
            return None
        from .checkpoint import resolve_resume

        spec = "latest" if train.resume == "auto" else train.resume
        return Path(dist.agree(lambda: str(resolve_resume(self.path, spec)), CheckpointError, main_only=True))

    def truncate_logs(self, last_step: int) -> None:
        """A killed run may have logged iterations after its last checkpoint: drop them, so the logs
        continue without duplicate or missing steps."""
        if dist.is_main():
            for name in ("metrics.jsonl", "rollouts.jsonl"):
                path = self.path / name
                if not path.is_file():
                    continue
                keep = [line for line in path.read_text(encoding="utf-8").splitlines(keepends=True)
                        if line.strip() and json.loads(line)["step"] <= last_step]
                tmp = path.with_suffix(path.suffix + ".tmp")
                with writing(tmp, "resuming the logs"):
                    tmp.write_text("".join(keep), encoding="utf-8")
                    os.replace(tmp, path)
        dist.barrier()

    # --- checkpoints and final/ (collective) -----------------------------------------------------
    def checkpoint(self, step: int, policy: Any, learner: Any, state: Any, ckpt: CheckpointConfig,
                   stopping: bool = False) -> None:
        """Stage 7 (collective): a checkpoint every ``checkpoint.interval`` iterations, then, with
        ``checkpoint.on_signal``, the pre-emption check. The ranks agree (one all-reduce of one number)
        whether any of them received SIGTERM or SIGUSR1; if so, every rank writes the checkpoint of this
        iteration (unless it was just written) and raises ``Preempted``: all stop after the same
        iteration, and ``train.resume: auto`` continues exactly from there. A signal that arrives while a
        checkpoint is being written is seen here, once the write is complete. ``stopping`` (a callback's
        "stop", already agreed by every rank): the run ends after this iteration, so with checkpoints on
        this iteration's is written too (the run stays resumable)."""
        due = bool(ckpt.interval) and (step % ckpt.interval == 0 or stopping)
        path = self.save_checkpoint(step, policy, learner, state, ckpt.keep_last) if due else None
        if not ckpt.on_signal:
            return
        signum = dist.any_stop(requested_stop())
        if signum:
            path = path or self.save_checkpoint(step, policy, learner, state, ckpt.keep_last)
            raise Preempted(signum, step, path)

    def save_checkpoint(self, step: int, policy: Any, learner: Any, state: Any, keep_last: int) -> Path:
        from .checkpoint import save_checkpoint

        def claim_folder() -> None:  # the first checkpoint: the folder is listed in the manifest first
            if not (self.path / "checkpoints").exists():
                with writing(self.path / "checkpoints", f"saving checkpoint step_{step}"):
                    self.claim("checkpoints", is_dir=True)

        # through agree: a failure on the main rank stops every rank here, not in a later collective
        dist.agree(claim_folder, CheckpointError, main_only=True)
        return save_checkpoint(self.path, step, policy, learner.optimizer,
                               {**state.state_dict(), "scheduler": learner.scheduler_state()},
                               state.shuffle_gen, keep_last)

    def save_final(self, policy: Any, tokenizer: Any, result: "TrainResult | None" = None) -> None:
        """``final/``: the policy via ``save_pretrained`` plus the tokenizer, loadable with plain
        transformers, and ``README.md``, a Hugging Face model card (``rallyrl.card``; with the run's
        ``result``: its iterations and last metrics). Written by the main rank; a failure there stops
        every rank with the cause. A sharded policy is first assembled on the main rank (on CPU, one
        block at a time: one full copy). ``final/`` is rallyrl's folder (the manifest), so
        ``train.overwrite`` removes the card with the weights."""
        full = dist.full_state_dict(policy)  # collective under FSDP; None when every rank holds it all

        def save() -> None:
            with writing(self.path / "final", f"saving {self.path / 'final'}"):
                out = self.claim("final", is_dir=True)
                from transformers.utils import logging as hf_logging

                hf_logging.disable_progress_bar()
                policy.save_pretrained(out) if full is None else policy.save_pretrained(out, state_dict=full)
                tokenizer.save_pretrained(out)
                if self.cfg is not None:
                    from .card import model_card

                    r = result or TrainResult(self.path)
                    (out / "README.md").write_text(model_card(
                        self.cfg, r.iterations, r.metrics[-1] if r.metrics else {}, r.eval_before, r.eval_after,
                        r.stopped_by, dist.world_size()), encoding="utf-8")

        dist.agree(save, CheckpointError, main_only=True, what=f"saving {self.path / 'final'}")


class Tracker(Protocol):
    """Where the config and each iteration's metrics go (main rank only)."""

    def start(self, config: dict[str, Any]) -> None:
        """Begin (or, on a resume, continue) the run; ``config`` is flat: ``{"ppo.lr": 1e-05, ...}``."""

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """One iteration's metrics (step 0: the evaluation before training)."""

    def close(self) -> None: ...


class MetricsFile:
    """``metrics.jsonl``: one strict-JSON line per iteration (non-finite values as ``null``), flushed per
    line. Always on; the other trackers come from ``train.report_to``."""

    def __init__(self, path: Path) -> None:
        self._f = open(path, "a", encoding="utf-8")

    def start(self, config: dict[str, Any]) -> None:
        pass  # the config is config.yaml

    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, **{k: _clean(v) for k, v in sorted(metrics.items())}}
        self._f.write(json.dumps(row, allow_nan=False) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


class RunWriter:
    """The main rank's log files and trackers. Every write of rallyrl's own files goes through
    ``errors.writing``: a full disk or a permission problem is one line naming the file, not a traceback."""

    def __init__(self, run_dir: RunDir, cfg: Config, resuming: bool = False) -> None:
        self.run_dir = run_dir
        self._rollouts = open(run_dir.claim("rollouts.jsonl"), "a", encoding="utf-8")
        state = trackers.TrackerState(run_dir.path / trackers.STATE_FILE, resuming, run_dir.claim)
        self._metrics = MetricsFile(run_dir.claim("metrics.jsonl"))
        self.trackers: list[Tracker] = [self._metrics]
        self.trackers += trackers.create(trackers.chosen(cfg), cfg, state,
                                         lambda: run_dir.claim("tensorboard", is_dir=True))
        self._started: list[Tracker] = []

    def start(self, cfg: Config) -> None:
        """Start every tracker (a failure propagates: ``RunDir.open`` stops every rank with it)."""
        flat = flat_config(cfg)
        for t in self.trackers:
            t.start(flat)
            self._started.append(t)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        with writing(self.run_dir.path / "metrics.jsonl", "logging metrics"):
            self._metrics.log(step, metrics)
        for t in [t for t in self._started if t is not self._metrics]:
            try:
                t.log(step, metrics)
            except Exception as e:
                # A tracker that fails mid-run (a lost server) must not stop training, and only this
                # rank would see it: it is dropped with one line; metrics.jsonl has every iteration.
                self._started.remove(t)
                print(f"rallyrl: warning: {type(t).__name__.lower()} failed at iteration {step} ({type(e).__name__}: "
                      f"{e}); it logs nothing more in this run (metrics.jsonl has every iteration)", file=sys.stderr)

    def log_rollouts(self, records: list[dict[str, Any]]) -> None:
        with writing(self._rollouts.name, "logging rollouts"):
            for r in records:
                self._rollouts.write(_text_line(json.dumps({k: _clean(v) for k, v in r.items()},
                                                           ensure_ascii=False, allow_nan=False)))
            self._rollouts.flush()

    def log_eval_samples(self, step: int, records: list[dict[str, Any]]) -> None:
        path = self.run_dir.path / f"eval/step_{step}.jsonl"
        with writing(path, "logging eval samples"):
            if not (self.run_dir.path / "eval").exists():
                self.run_dir.claim("eval", is_dir=True)
            with open(self.run_dir.claim(f"eval/step_{step}.jsonl"), "w", encoding="utf-8") as f:
                for r in records:
                    f.write(_text_line(json.dumps(r, ensure_ascii=False)))

    def close(self) -> None:
        with writing(self.run_dir.path, "closing the logs"):
            self._rollouts.close()
            self._metrics.close()
        for t in self._started:
            if t is not self._metrics:
                try:
                    t.close()
                except Exception as e:  # the run's outcome stands; the tracker's last words are a warning
                    print(f"rallyrl: warning: closing {type(t).__name__.lower()} failed ({type(e).__name__}: {e})",
                          file=sys.stderr)
        self._started = []


@dataclass
class TrainResult:
    run_dir: Path
    metrics: list[dict[str, float]] = field(default_factory=list)  # one dict per iteration (main rank)
    eval_before: dict[str, float] = field(default_factory=dict)  # eval/* before the first iteration
    eval_after: dict[str, float] = field(default_factory=dict)  # eval/* of the latest evaluation
    iterations: int = 0  # the last completed iteration (also after a resume)
    stopped_by: str | None = None  # "EarlyStop.on_iteration" when a callback ended the run early


def wait_notice_after_s() -> float:
    """Seconds of waiting for the reward before the progress line says so: 5, or ``RALLYRL_WAIT_NOTICE_S``
    (an internal knob, for tests)."""
    try:
        return float(os.environ.get("RALLYRL_WAIT_NOTICE_S", "5"))
    except ValueError:
        return 5.0


def stderr_is_terminal() -> bool:
    """A progress bar redraws itself with carriage returns: only a terminal shows that as one line."""
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stderr
        return False


class RunLog:
    """Progress bar, the per-iteration line, the run-dir writers (main rank; no-ops elsewhere) and the
    run's callbacks (``rallyrl.callbacks``: run on the main rank, their decisions agreed by all).

    Progress: a bar only when ``train.progress`` is on and stderr is a terminal; in a log (CI, ``nohup``,
    a job scheduler) each iteration is one plain line, never a bar's redraws glued to it."""

    def __init__(self, writer: RunWriter | None, cfg: Config, start: int, result: TrainResult,
                 callbacks: Sequence[Any] | None = None) -> None:
        self.writer, self.total, self.result = writer, cfg.train.iterations, result
        self.result.iterations = start
        self.callbacks = Callbacks(callbacks)
        self.log_rollouts = cfg.train.log_rollouts
        self.bar = None
        if cfg.train.progress and dist.is_main() and stderr_is_terminal():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=self.total, initial=start, desc="ppo", unit="it", file=sys.stderr,
                            dynamic_ncols=True, leave=False)

    def start(self, plan: Any, cfg: Config, resumed_from: Path | None, iteration: int,
              was_world_size: int | None = None) -> None:
        self.say(f"rallyrl: {plan.world_size} process(es), {plan.num_rollouts} rollouts/iteration "
                 f"({'/'.join(map(str, plan.local_counts))} per rank, {plan.rounds} chunk round(s)), "
                 f"{cfg.train.iterations} iterations, reward placement '{cfg.reward.placement}'"
                 + (f", estimator {cfg.ppo.estimator} with {cfg.rollout.samples_per_prompt} completions per prompt"
                    if cfg.rollout.samples_per_prompt > 1 or cfg.ppo.critic_free else ""))
        for warning in config_warnings(cfg):
            self.say(f"rallyrl: warning: {warning}")
        if resumed_from is not None:
            self.say(f"resumed from {resumed_from} at iteration {iteration}")
        if resumed_from is not None and was_world_size is not None and was_world_size != plan.world_size:
            n = plan.world_size
            self.say(f"rallyrl: the run continues from step {iteration} on {n} process{'' if n == 1 else 'es'} (was "
                     f"{was_world_size}); weights, optimizer, LR schedule, KL controller, reward moments and the "
                     f"prompt position carried over, the per-rank random streams (generation sampling, "
                     f"minibatch order) were re-derived from train.seed, the rank and the iteration, so it is "
                     f"not bit-identical to an uninterrupted run (recorded in config_history.jsonl)")
        try:
            self.callbacks.start({"run_dir": self.result.run_dir, "config": cfg, "world_size": plan.world_size,
                                  "iterations": cfg.train.iterations, "start_iteration": iteration,
                                  "resumed_from": resumed_from, "num_rollouts": plan.num_rollouts})
        except BaseException:
            self.close()  # before the trainer's try: the trackers end here, as failed
            raise

    def interrupted(self, completed: int, newest: Path | None, stop: BaseException | None = None) -> None:
        """Ctrl-C: close the bar first so the line stands on its own, then say how to continue. A
        pre-emption stop (``Preempted``) names the checkpoint it wrote."""
        self.close()
        if isinstance(stop, Preempted):
            self.say(f"rallyrl: stopped by {signal.Signals(stop.signum).name} after iteration {stop.iteration}; "
                     f"checkpoint {stop.checkpoint} written; continue with --set train.resume=auto (or latest)")
        elif newest is None:
            self.say(f"rallyrl: interrupted at iteration {completed + 1}; no checkpoint to resume from "
                     f"(set checkpoint.interval to make runs resumable)")
        else:
            self.say(f"rallyrl: interrupted at iteration {completed + 1}; newest checkpoint {newest.name}; "
                     f"resume with --set train.resume=latest")

    @contextlib.contextmanager
    def waiting(self, what: str) -> Iterator[None]:
        """While the block runs for longer than ``wait_notice_after_s()`` (5 s), the progress output says
        so: ``"<what>, 42 s"`` (e.g. "waiting for the reward on rank 0, 42 s"). With a progress bar it is
        the bar's postfix, updated in place every second and cleared afterwards; without one, a line at
        5 s, 10 s, 20 s, 40 s, ... (doubling: a long wait is visible, a log is not flooded). Main rank
        only; a helper thread does the telling, the block itself is untouched."""
        if not dist.is_main():
            yield
            return
        after, t0, done = wait_notice_after_s(), time.monotonic(), threading.Event()
        shown = False

        def tell() -> None:
            nonlocal shown
            next_line = after
            while not done.wait(min(1.0, after) if shown else after):
                waited = time.monotonic() - t0
                bar = self.bar
                if bar is not None:
                    bar.set_postfix_str(f"{what}, {waited:.0f} s")
                    shown = True
                elif waited >= next_line:
                    self.say(f"rallyrl: {what}, {waited:.0f} s")
                    shown, next_line = True, next_line * 2

        helper = threading.Thread(target=tell, name="rallyrl-wait-notice", daemon=True)
        helper.start()
        try:
            yield
        finally:
            done.set()
            helper.join()
            if shown and self.bar is not None:
                self.bar.set_postfix_str("")

    def say(self, msg: str) -> None:
        if not dist.is_main():
            return
        if self.bar is not None:
            self.bar.write(msg, file=sys.stderr)
        else:
            print(msg, file=sys.stderr, flush=True)

    def eval(self, step: int, metrics: dict[str, float], samples: list[dict[str, Any]]) -> dict[str, float]:
        if self.writer:
            self.writer.log_eval_samples(step, samples)
        self.say("eval @ %d: %s" % (step, ", ".join(f"{k}={v:.4f}" for k, v in metrics.items() if k.startswith("eval/"))))
        if step > 0:
            self.result.eval_after = {k: v for k, v in metrics.items() if k.startswith("eval/")}
        self.callbacks.eval(step, metrics)
        return metrics

    def eval_before(self, metrics: dict[str, float]) -> None:
        """The evaluation of the initial policy: a ``step: 0`` row, so every eval curve starts there."""
        self.result.eval_before = {k: v for k, v in metrics.items() if k.startswith("eval/")}
        if self.writer:
            self.writer.log_metrics(0, metrics)

    def rollouts(self, ro: "Rollouts", advantages: list[float], step: int, rank: int) -> None:
        """One row per sample: its group and its (sequence) advantage (``gae``: the first response
        token's), and its KL to the reference (null without a reference). Nothing with
        ``train.log_rollouts: false``."""
        if not self.log_rollouts:
            return
        totals: list[float | None] = ro.total_rewards().tolist()
        if ro.scorable is not None:  # null: the sample has no reward (every reward function returned None)
            totals = [t if ok else None for t, ok in zip(totals, ro.scorable.tolist())]
        kls = ((ro.logprobs - ro.ref_logprobs).mul(ro.response_mask).sum(1).tolist() if ro.ref_logprobs is not None
               else [None] * len(ro))
        recs = [{"step": step, "rank": rank, "index": i, "group": ro.group[k], "prompt": p, "output": o,
                 "reward": totals[k], "advantage": advantages[k], "kl": kls[k]}
                for k, (i, p, o) in enumerate(zip(ro.global_index, ro.prompts, ro.outputs))]
        gathered = dist.gather_objects(recs, dst=0)
        if self.writer and gathered:
            self.writer.log_rollouts([r for part in gathered for r in part])

    def iteration(self, step: int, m: dict[str, float]) -> bool:
        """Log iteration ``step`` and run the callbacks; True (on every rank) when one asked to stop."""
        self.result.iterations = step
        if self.writer:
            self.writer.log_metrics(step, m)
            self.result.metrics.append(m)
        self._line(step, m)
        if not self.callbacks.iteration(step, m):
            return False
        self.result.stopped_by = self.callbacks.stopped_by
        self.say(f"rallyrl: {self.callbacks.stopped_by} asked to stop: the run ends after iteration {step} of "
                 f"{self.total} (a checkpoint if checkpoint.interval is set, then final/)")
        return True

    def _line(self, step: int, m: dict[str, float]) -> None:
        if not dist.is_main():
            return
        kl = f" | kl {m['policy/kl']:.4f}" if "policy/kl" in m else ""  # no reference: no KL
        line = (f"iter {step}/{self.total} | reward {m['reward/mean']:.4f}{kl} | "
                f"loss {m['policy/total_loss']:.4f} | clipfrac {m['policy/clipfrac']:.3f} | {m['time/iteration']:.2f}s")
        extra = [f"{k}={v:.4f}" for k, v in m.items() if k.startswith("eval/")]
        if extra:
            line += " | " + " ".join(extra)
        if self.bar is not None:
            self.bar.update(1)
        self.say(line)

    def close(self) -> None:
        # The bar is closed before anything else is printed, so an error line stands on its own.
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.writer:
            self.writer.close()
            self.writer = None


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# Line breaks that json.dumps(ensure_ascii=False) leaves raw inside strings, but str.splitlines() (and
# so resume's log truncation and most readers) splits on: sampled text can contain them.
_RAW_BREAKS = {"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"}


def _text_line(dumped: str) -> str:
    """One JSON document as exactly one line, whatever ``splitlines`` variant reads it back."""
    for raw, esc in _RAW_BREAKS.items():
        dumped = dumped.replace(raw, esc)
    return dumped + "\n"

