"""The ``rallyrl train CONFIG --nproc N`` launcher: N local worker processes, one line per failure.

Why not hand the job to ``torchrun``: its agent prints a traceback block of its own when a worker fails,
names as root cause the rank whose error file it saw first (often a healthy rank that only noticed its
peer was gone), and when the launching process alone gets SIGINT or SIGTERM (a job scheduler, a
container stop) the workers kept running. This launcher keeps the job's life in one place:

- each worker runs ``python -m rallyrl.cli ...`` with the environment ``torchrun`` would give it
  (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), so
  ``accelerate`` forms the same process group (gloo on CPU, NCCL on GPU);
- each worker is in its own session, so a terminal's Ctrl-C reaches the launcher only, and the launcher
  forwards it (and SIGTERM) to every worker's process group exactly once; a second signal, or workers
  still alive after ``STOP_TIMEOUT_S``, gets SIGKILL. The launcher returns only when no worker is left,
  and a worker whose launcher dies gets SIGTERM from the kernel (``PR_SET_PDEATHSIG``);
- with ``checkpoint.on_signal`` (``graceful``), SIGTERM and SIGUSR1 are a pre-emption: forwarded to every
  worker as they are, every time (the workers only record them), with no SIGKILL after it: the workers
  finish the iteration, write a checkpoint and exit 143, and so does the launcher. The scheduler's own
  SIGKILL, or a second Ctrl-C, still ends a run that cannot stop;
- the run-directory lock the launcher took (``run.lock.RunDirLock``) is handed to the main rank as an
  inherited file descriptor, so it is held for as long as either of them lives;
- a failing worker does not print its error line: it writes it to a report file
  (``rallyrl.cli._report``); the launcher prints the first failure of all ranks once, names its rank
  and exits with that worker's code. A worker killed by a signal it was not sent (the OOM killer) is
  the root cause whatever the others said after it. Healthy ranks get ``FAIL_GRACE_S`` to stop on their
  own (the reward step's failure is collective), then SIGKILL.

Several machines (``--nnodes M --node-rank R --master-addr HOST --master-port P``): run the same
command on every machine, each with its own ``--node-rank``. This launcher then starts its ``N`` local
workers as global ranks ``R * N .. R * N + N - 1`` of a world of ``M * N`` (``NODE_RANK``/``GROUP_RANK`` =
R); they rendezvous at ``HOST:P``, where global rank 0 (node 0's first worker, the reward host) holds the
process group's store. Each node's launcher watches only its own workers: a worker dying on one node makes
its peers on the other nodes fail in their next collective (at once when the connection drops, at worst
after ``dist.timeout_s``), and each launcher prints its own first failure naming the rank (docs/scaling.md).
``torchrun --nnodes`` and ``accelerate launch --num_machines`` work too: rallyrl runs as their worker.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPORT_DIR_ENV = "RALLYRL_REPORT_DIR"
# The run-dir lock's descriptor, passed to global rank 0 as "<fd>:<lock file>" (``run.lock.RunDirLock``).
LOCK_FD_ENV = "RALLYRL_RUN_DIR_LOCK_FD"
STOP_TIMEOUT_S = 30.0  # after SIGINT/SIGTERM: how long workers get to stop before SIGKILL
FAIL_GRACE_S = 10.0  # after the first failure: how long the other ranks get to stop on their own
_POLL_S = 0.05


def write_report(folder: str, rank: int, code: int, line: str) -> None:
    """A worker's failure, for the launcher: written whole (rename) so a reader never sees half."""
    path = Path(folder) / f"rank{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"rank": rank, "code": code, "line": line, "time": time.time()}))
    os.replace(tmp, path)


def _read_reports(folder: Path) -> dict[int, dict]:
    out = {}
    for p in folder.glob("rank*.json"):
        try:
            r = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        out[int(r["rank"])] = r
    return out


@contextlib.contextmanager
def before_workers(graceful: bool) -> Iterator[None]:
    """The launcher's first seconds (it checks the config, loads the tokenizer and the prompts) before
    any worker exists: SIGINT, SIGTERM and, with ``graceful`` (``checkpoint.on_signal``), SIGUSR1 stop it
    with one line instead of killing it silently (Python's default for SIGTERM and SIGUSR1). The exit
    code is what a later stop gives: 143 for a pre-emption signal with ``graceful``, else 128 + the
    signal."""
    from .errors import STOP_SIGNALS, Interrupted, forget_interrupts, interrupt_received, raise_if_interrupted

    caught = (signal.SIGINT, signal.SIGTERM) + ((signal.SIGUSR1,) if graceful else ())
    previous = {s: signal.signal(s, interrupt_received) for s in caught}
    try:
        yield
        raise_if_interrupted()  # a signal whose exception was dropped on the way (errors.raise_if_interrupted)
    except Interrupted as e:
        if graceful and e.signum in STOP_SIGNALS:
            e.exit_code = 128 + signal.SIGTERM
        print(f"rallyrl: stopped by {signal.Signals(e.signum).name} before any worker started (while checking the "
              f"run); nothing was trained: run the same command again to start", file=sys.stderr, flush=True)
        raise
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        forget_interrupts()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with(parent: int) -> None:
    """In the child, before exec: get SIGTERM when the launcher dies (Linux), even by SIGKILL."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass  # not Linux: the signal forwarding still covers SIGINT/SIGTERM to the launcher
    if os.getppid() != parent:  # the launcher died before prctl took effect
        os._exit(143)


@dataclass
class _Worker:
    rank: int
    proc: subprocess.Popen
    exited_at: float | None = None
    signalled: bool = False  # this launcher sent it a signal (its death by one is then no surprise)


def _signal_group(w: _Worker, sig: int) -> None:
    w.signalled = True
    try:
        os.killpg(w.proc.pid, sig)  # the worker and anything it started (its own session and group)
    except (ProcessLookupError, PermissionError):
        pass


@dataclass(frozen=True)
class Nodes:
    """Where this machine's workers sit in a job over ``nnodes`` machines (one machine by default)."""

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None  # default 127.0.0.1 on one machine; required for several
    master_port: int | None = None  # default a free port on one machine; required for several

    def __post_init__(self) -> None:
        if self.nnodes < 1:
            raise ValueError(f"--nnodes must be >= 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in 0..{self.nnodes - 1} for --nnodes {self.nnodes}, "
                             f"got {self.node_rank}")
        if self.nnodes > 1 and (not self.master_addr or not self.master_port):
            raise ValueError(f"--nnodes {self.nnodes} needs --master-addr and --master-port: the address and "
                             f"a free port of node 0's machine, the same on every node")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ValueError(f"--master-port must be in 1..65535, got {self.master_port}")


def worker_env(nproc: int, nodes: Nodes, local_rank: int) -> dict[str, str]:
    """The ``torchrun`` variables of one worker: global rank = node_rank * nproc + local_rank."""
    rank = nodes.node_rank * nproc + local_rank
    world = nodes.nnodes * nproc
    return {"RANK": str(rank), "LOCAL_RANK": str(local_rank), "ROLE_RANK": str(rank),
            "WORLD_SIZE": str(world), "ROLE_WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(nproc),
            "GROUP_RANK": str(nodes.node_rank), "NODE_RANK": str(nodes.node_rank)}


def launch(module_args: list[str], nproc: int, nodes: Nodes | None = None, lock: Any = None,
           graceful: bool = False) -> int:
    """Run ``python -m <module_args>`` as ``nproc`` ranks of one job on this machine (this node's share
    of the job when ``nodes`` spans several); return the exit code (0, the first failing worker's code,
    143 after a pre-emption stop, or 128 + the signal that stopped the job). ``lock``: the run-directory
    lock (``run.lock.RunDirLock``) this launcher holds, passed on to global rank 0. ``graceful``:
    ``checkpoint.on_signal``."""
    nodes = nodes or Nodes()
    job = _Job(Path(tempfile.mkdtemp(prefix="rallyrl-launch-")), graceful)
    base = dict(os.environ)
    # Split the cores between the processes (the trainer reads it through torch's defaults).
    base.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    base.update({"MASTER_ADDR": nodes.master_addr or "127.0.0.1",
                 "MASTER_PORT": str(nodes.master_port or _free_port()), REPORT_DIR_ENV: str(job.report_dir)})
    caught = (signal.SIGINT, signal.SIGTERM) + ((signal.SIGUSR1,) if graceful else ())
    previous = {s: signal.signal(s, job.on_signal) for s in caught}
    try:
        job.start(module_args, nproc, nodes, lock, base)
        job.wait()
        return job.outcome(nodes)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        shutil.rmtree(job.report_dir, ignore_errors=True)


class _Job:
    """This launcher's workers and what happened to them: the signals received, the first failure."""

    def __init__(self, report_dir: Path, graceful: bool) -> None:
        from .errors import STOP_SIGNALS

        self.report_dir, self.stop_signals = report_dir, STOP_SIGNALS if graceful else ()
        self.workers: list[_Worker] = []
        self.stop: list[int] = []  # the signals received, in order (not the pre-emption signals of a graceful run)
        self.stop_at: list[float] = []
        self.preempted: list[int] = []  # SIGTERM/SIGUSR1 received with `graceful`
        self.sent_kill = False  # the SIGKILL after STOP_TIMEOUT_S / FAIL_GRACE_S, sent once

    def on_signal(self, signum: int, frame: object) -> None:
        if signum in self.stop_signals and not self.stop:
            self.preempted.append(signum)
            for w in self.workers:
                if w.proc.poll() is None:
                    _signal_group(w, signum)  # the worker records it; the ranks agree when to stop
            return
        self.stop.append(signum)
        self.stop_at.append(time.monotonic())
        for w in self.workers:
            if w.proc.poll() is None:
                _signal_group(w, signum if len(self.stop) == 1 else signal.SIGKILL)

    def start(self, module_args: list[str], nproc: int, nodes: Nodes, lock: Any, base: dict[str, str]) -> None:
        me = os.getpid()
        for r in range(nproc):
            env = {**base, **worker_env(nproc, nodes, r)}
            fds: tuple[int, ...] = ()
            if lock is not None and nodes.node_rank * nproc + r == 0:
                env[LOCK_FD_ENV], fds = f"{lock.fd}:{lock.path}", (lock.fd,)
            proc = subprocess.Popen([sys.executable, "-m", *module_args], env=env, start_new_session=True,
                                    preexec_fn=lambda: _die_with(me), pass_fds=fds)
            self.workers.append(_Worker(nodes.node_rank * nproc + r, proc))
            if self.stop or self.preempted:  # a signal arrived while starting: the new worker gets it too
                _signal_group(self.workers[-1], (self.stop or self.preempted)[0])

    def wait(self) -> None:
        """Until no worker is left; SIGKILL to the rest once a stop or the first failure is overdue."""
        first_failure_at: float | None = None
        while True:
            now = time.monotonic()
            for w in self.workers:
                if w.exited_at is None and w.proc.poll() is not None:
                    w.exited_at = time.time()
                    if w.proc.returncode != 0 and first_failure_at is None:
                        first_failure_at = now
            alive = [w for w in self.workers if w.exited_at is None]
            if not alive:
                return
            if first_failure_at is None and _read_reports(self.report_dir):
                first_failure_at = now
            overdue = ((self.stop and now - self.stop_at[0] > STOP_TIMEOUT_S)
                       or (not self.stop and first_failure_at is not None and now - first_failure_at > FAIL_GRACE_S))
            if overdue and not self.sent_kill:
                self.sent_kill = True
                for w in alive:
                    _signal_group(w, signal.SIGKILL)
            time.sleep(_POLL_S)

    def outcome(self, nodes: Nodes) -> int:
        """The job's exit code, printing the first failure's line when it failed."""
        if self.stop:
            return 128 + self.stop[0]
        if all(w.proc.returncode == 0 for w in self.workers):
            return 0
        preempt_code = 128 + signal.SIGTERM
        # (a worker the signal reached before it could catch it, still starting up, ends by the signal)
        stopped = {0, preempt_code, *(-s for s in self.preempted)}
        if all(w.proc.returncode in stopped for w in self.workers) and not _read_reports(self.report_dir):
            return preempt_code  # every rank stopped after the same iteration, with a checkpoint
        for w in self.workers:  # anything a failed worker started and left behind
            try:
                os.killpg(w.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        code, line = _first_failure(self.workers, _read_reports(self.report_dir), nodes)
        print(line, file=sys.stderr)
        return code


def _first_failure(workers: list[_Worker], reports: dict[int, dict], nodes: Nodes | None = None) -> tuple[int, str]:
    """The failure to show: a worker killed by a signal nobody here sent it (the others only noticed
    it was gone), else the earliest reported error, else the earliest worker that exited non-zero.
    Over several nodes this launcher sees only its own workers: a report is always tagged with its rank
    and node, since the cause may be a worker of another node (whose launcher names it)."""
    nodes = nodes or Nodes()
    dead = [w for w in workers if w.proc.returncode < 0 and not w.signalled and w.rank not in reports]
    if dead:
        w = min(dead, key=lambda w: w.exited_at or 0.0)
        name = signal.Signals(-w.proc.returncode).name
        return 128 - w.proc.returncode, (
            f"rallyrl: WorkerKilled: rank {w.rank} was killed by {name} (exit code {128 - w.proc.returncode})"
            f"; the other ranks stopped because of it (a SIGKILL nobody sent is often the out-of-memory "
            f"killer: see dmesg)")
    if reports:
        r = min(reports.values(), key=lambda r: r["time"])
        line = r["line"]
        same_everywhere = (nodes.nnodes == 1 and len(reports) == len(workers)
                           and len({x["line"] for x in reports.values()}) == 1)
        if nodes.nnodes > 1:
            line += (f" (on rank {r['rank']}, node {nodes.node_rank} of {nodes.nnodes}; if a peer was lost, "
                     f"the other nodes' output names the rank that stopped first)")
        elif not same_everywhere and f"rank {r['rank']}" not in line:
            line += f" (on rank {r['rank']})"
        return int(r["code"]), line
    failed = [w for w in workers if w.proc.returncode > 0]
    if failed:
        w = min(failed, key=lambda w: w.exited_at or 0.0)
        return w.proc.returncode, (f"rallyrl: WorkerFailed: rank {w.rank} exited with code "
                                   f"{w.proc.returncode} without an error message")
    w = next(w for w in workers if w.proc.returncode != 0)
    return 1, f"rallyrl: WorkerFailed: rank {w.rank} stopped (exit code {w.proc.returncode})"
