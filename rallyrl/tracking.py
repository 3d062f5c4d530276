"""Compatibility: the names ``rallyrl.tracking`` used to hold, now in ``rallyrl.run`` (the run directory,
its lock, logs and console) and ``rallyrl.trackers`` (the ``Tracker`` protocol). Import from there in
new code; these names keep working."""

from __future__ import annotations

from .run.console import RunLog, TrainResult, stderr_is_terminal, wait_notice_after_s
from .run.lock import (LOCK_FD_ENV, LOCK_FILE, RunDirBusyError, RunDirError, RunDirLock, holding_run_dir_locks,
                       releases_run_dir_lock)
from .run.logs import MetricsFile, RunWriter, read_jsonl
from .run.rundir import MANIFEST, OUTPUTS, RunDir
from .trackers import Tracker

__all__ = ["LOCK_FD_ENV", "LOCK_FILE", "MANIFEST", "OUTPUTS", "MetricsFile", "RunDir", "RunDirBusyError", "RunDirError",
           "RunDirLock", "RunLog", "RunWriter", "TrainResult", "Tracker", "holding_run_dir_locks", "read_jsonl",
           "releases_run_dir_lock", "stderr_is_terminal", "wait_notice_after_s"]
