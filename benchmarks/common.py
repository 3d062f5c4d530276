"""Shared pieces of the benchmarks: reading run directories, steady-state statistics, the iteration
profile, peak RSS of a process tree measured from outside, and subprocess timing.

Nothing here imports torch at module level, so the orchestrator and the unit tests stay light.

Metric names: only ``time/*``, ``reward/*`` and ``eval/*`` keys are read from ``metrics.jsonl`` (other
namespaces are being renamed, e.g. ``opt/steps`` -> ``policy/optimizer_steps``; ``first_key`` tolerates
both spellings where a benchmark needs one of them).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

# Every benchmark process: offline, one torch thread (2 shared cores), quiet libraries.
ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "ACCELERATE_MIXED_PRECISION": "no",
}

# The phases of a rallyrl iteration, from metrics.jsonl (main rank). `reward` is the whole reward step
# as the main rank sees it: time inside reward functions plus moving samples/rewards between ranks.
PROFILE_PHASES = {
    "generate": ("time/generate",),
    "forward": ("time/forward",),
    "reward": ("time/reward", "time/reward_gather"),
    "update": ("time/update",),
}


class BenchError(RuntimeError):
    """A benchmark run failed or produced something unusable (the message says which and where)."""


# ------------------------------------------------------------------------------------------------
# Run directories


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The per-iteration records of ``run_dir/metrics.jsonl`` (a clear error if there are none)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise BenchError(f"{path} does not exist: the run did not log any iteration")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("step", 1) >= 1]  # step 0 is the evaluation before training
    if not rows:
        raise BenchError(f"{path} is empty: the run did not log any iteration")
    return rows


def first_key(row: dict[str, Any], *names: str, default: Any = None) -> Any:
    """The value of the first of ``names`` present in ``row`` (for metrics renamed between versions)."""
    for n in names:
        if n in row:
            return row[n]
    return default


def read_rollouts(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "rollouts.jsonl"
    if not path.is_file():
        raise BenchError(f"{path} does not exist (train.log_rollouts must be on)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def loop_iteration_times(metrics: Sequence[dict[str, Any]]) -> list[float]:
    """``time/iteration`` per iteration without evaluation (rallyrl evaluates inside the timer of the
    iteration that evaluates; ``time/eval`` is logged with it and subtracted here)."""
    return [float(m["time/iteration"]) - float(m.get("time/eval", 0.0)) for m in metrics]


# ------------------------------------------------------------------------------------------------
# Statistics


def steady(values: Sequence[float], warmup: int) -> list[float]:
    """``values`` without the first ``warmup`` (model loading, first-call allocations, lazy imports)."""
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    if len(values) <= warmup:
        raise BenchError(f"need more than {warmup} warm-up value(s) to measure anything, got {len(values)}")
    return list(values[warmup:])


def spread(values: Sequence[float]) -> dict[str, float]:
    """min / median / max (and n) of a non-empty sample."""
    if not values:
        raise BenchError("no values to summarise")
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}


def episodes_per_s(iteration_s: Sequence[float], episodes_per_iteration: int, warmup: int) -> float:
    """Throughput after warm-up: episodes of the steady iterations / their summed time."""
    times = steady(iteration_s, warmup)
    total = sum(times)
    if total <= 0:
        raise BenchError(f"non-positive iteration time {total}")
    return episodes_per_iteration * len(times) / total


def profile(metrics: Sequence[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """Where a rallyrl iteration's time goes, from its ``time/*`` metrics: per phase the MEAN seconds
    per steady iteration and its share of the mean loop iteration (means, not medians, so that the
    phases and ``other`` add up to the iteration); ``other`` is what the four phases do not cover
    (advantages, the statistics all-reduce, logging rollouts, Python)."""
    rows = steady(metrics, warmup)
    it = statistics.fmean(loop_iteration_times(rows))
    out: dict[str, Any] = {"iteration_s": it, "phases": {}}
    covered = 0.0
    for phase, keys in PROFILE_PHASES.items():
        mean = statistics.fmean(sum(float(r.get(k, 0.0)) for k in keys) for r in rows)
        covered += mean
        out["phases"][phase] = {"s": mean, "share": mean / it if it > 0 else 0.0}
    other = it - covered
    out["phases"]["other"] = {"s": other, "share": other / it if it > 0 else 0.0}
    return out


def median_ratio(num: Sequence[float], den: Sequence[float]) -> float:
    """median(num) / median(den)."""
    d = statistics.median(den)
    if d <= 0:
        raise BenchError(f"non-positive baseline median {d}")
    return statistics.median(num) / d


# ------------------------------------------------------------------------------------------------
# Peak RSS of a process tree, from outside (/proc; Linux)


def _children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        # the command name (field 2) may contain spaces and parentheses: split after the last ')'
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(d))
    return kids


def descendants(pid: int) -> list[int]:
    kids = _children_map()
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for c in kids.get(p, []):
            out.append(c)
            todo.append(c)
    return out


def vm_hwm_kib(pid: int) -> int | None:
    """Peak resident set size (``VmHWM``, KiB) of a live process, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def env_rank(pid: int) -> int | None:
    """The ``RANK`` in a process's environment (torchrun sets it in each worker), or None."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            env = fh.read().split(b"\0")
    except OSError:
        return None
    for kv in env:
        if kv.startswith(b"RANK="):
            try:
                return int(kv[5:])
            except ValueError:
                return None
    return None


class PeakRSSMonitor:
    """Polls the descendants of ``pid`` and keeps, per rank (the worker's ``RANK``), the last seen
    ``VmHWM``. VmHWM only grows, so the last reading before a worker exits is its peak, up to what it
    allocated in its last ``interval`` seconds (the workers' peaks come while scoring/training, long
    before they exit)."""

    def __init__(self, pid: int, interval: float = 0.1) -> None:
        self.pid, self.interval = pid, interval
        self.peak_kib: dict[int, int] = {}
        self.root_kib = 0  # the process started (a 1-process run is that process; else the launcher)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> "PeakRSSMonitor":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def poll(self) -> None:
        self.root_kib = max(self.root_kib, vm_hwm_kib(self.pid) or 0)
        for p in descendants(self.pid):
            rank = env_rank(p)
            hwm = vm_hwm_kib(p)
            if rank is None or hwm is None:
                continue
            # torchrun's agent also carries no RANK; a worker's own children (tokenizers threads are
            # threads, not processes) inherit it, so keep the largest per rank.
            self.peak_kib[rank] = max(self.peak_kib.get(rank, 0), hwm)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.poll()
            self._stop.wait(self.interval)


def run_timed(cmd: list[str], log: Path, cwd: Path = ROOT, extra_env: dict[str, str] | None = None,
              monitor: bool = False, timeout: float | None = None) -> dict[str, Any]:
    """Run ``cmd`` (stdout+stderr to ``log``) with the benchmark environment. Returns exit code, wall
    seconds, CPU seconds of the process tree and (``monitor=True``) the per-rank peak RSS in MiB."""
    env = {**os.environ, **ENV, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.update(extra_env or {})
    log.parent.mkdir(parents=True, exist_ok=True)
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=fh, stderr=subprocess.STDOUT)
        mon = PeakRSSMonitor(proc.pid) if monitor else None
        if mon:
            mon.__enter__()
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
            raise BenchError(f"{' '.join(cmd[:4])} ... ran past {timeout}s; see {log}") from None
        finally:
            if mon:
                mon.__exit__()
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    out: dict[str, Any] = {"rc": rc, "wall_s": wall,
                           "cpu_s": (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)}
    if mon:
        peaks = mon.peak_kib or {0: mon.root_kib}  # no worker with a RANK: the run was this one process
        out["peak_rss_mib"] = {str(r): kib / 1024 for r, kib in sorted(peaks.items())}
    if rc != 0:
        raise BenchError(f"{' '.join(cmd[:6])} ... failed with exit code {rc}; see {log}:\n"
                         + log.read_text()[-3000:])
    return out


# ------------------------------------------------------------------------------------------------
# Environment description


def versions(pkgs: Sequence[str] = ("torch", "transformers", "accelerate", "trl", "datasets", "rallyrl",
                                    "vaderSentiment")) -> dict[str, str]:
    import platform
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for p in pkgs:
        try:
            out[p] = version(p)
        except PackageNotFoundError:
            out[p] = "missing"
    return out


def machine() -> dict[str, Any]:
    import platform

    info: dict[str, Any] = {"cpus": os.cpu_count(), "platform": platform.platform(),
                            "load_1min": os.getloadavg()[0]}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                info["mem_gib"] = round(int(line.split()[1]) / 2**20, 1)
                break
    except OSError:
        pass
    return info


def git_state() -> dict[str, Any]:
    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return ""

    return {"commit": git("rev-parse", "HEAD"), "branch": git("rev-parse", "--abbrev-ref", "HEAD"),
            "uncommitted_changes": git("status", "--porcelain", "--", "rallyrl", "examples", "benchmarks").splitlines()}
