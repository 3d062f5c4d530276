"""``reward.server: local``: rank 0 runs ``rallyrl serve-reward`` as its own child process.

The "+1" of a 7+1 layout without a second command: the reward function (``reward.fn`` + ``reward.kwargs``,
e.g. ``rallyrl.reward:hf_classifier`` with ``device: cuda:7``) gets its own process, CUDA context and
memory on the main node, and the run talks to it through ``RemoteReward`` like to any server (so
``reward.overlap`` works with it). rallyrl owns the process's whole life:

- it binds 127.0.0.1 on a free port (``--port 0``; the port is read from the server's first line) and
  is used once ``GET /health`` answers;
- it is stopped (SIGTERM, then SIGKILL) when the run ends, fails or is interrupted (``RewardStep.close``
  in ``train()``'s ``finally``); it sits in its own session, so a terminal's Ctrl-C reaches the trainer,
  which then stops it in order, and if rank 0 dies without cleaning up (SIGKILL) the kernel sends the
  server SIGTERM (``PR_SET_PDEATHSIG``, Linux): no orphan server;
- its output (uvicorn's warnings, nothing per request) goes to a temporary log file, whose tail is in
  the error when the server does not come up.

The server imports ``reward.fn`` with this process's ``sys.path`` and working directory, so an import
path resolves the same way as in the trainer.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_POLL_S = 0.05


class LocalServerError(RuntimeError):
    """The local reward server did not come up (it exited, or did not answer in time)."""


def _die_with_parent(parent: int) -> None:
    """In the child, before exec: SIGTERM when the parent (rank 0) dies, even by SIGKILL (Linux)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass  # not Linux: the trainer's `finally` still stops it
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(143)


class LocalRewardServer:
    """One ``rallyrl serve-reward`` child process serving ``fn`` (an import path; ``kwargs``: it is a
    factory, as ``reward.kwargs``). ``start()`` returns its base URL once healthy; ``stop()`` is
    idempotent and safe to call at any point."""

    def __init__(self, fn: str, kwargs: dict[str, Any] | None = None, extra_args: Sequence[str] = (),
                 startup_timeout_s: float = 300.0) -> None:
        self.fn, self.kwargs, self.extra_args = fn, dict(kwargs or {}), list(extra_args)
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None
        self._log: Path | None = None

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "rallyrl.cli", "serve-reward", "--fn", self.fn]
        if self.kwargs:
            cmd += ["--kwargs", json.dumps(self.kwargs)]
        return cmd + ["--host", "127.0.0.1", "--port", "0", *self.extra_args]

    def start(self) -> str:
        """Start the process (unless ``launch`` already did) and wait until ``/health`` answers; returns
        ``http://127.0.0.1:PORT``. Raises ``LocalServerError`` (with the server's last output) if it
        exits or is not up in time; the process is stopped then."""
        self.launch()
        try:
            self.url = self._wait_ready(time.monotonic() + self.startup_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self.url

    def launch(self) -> None:
        """Spawn the process without waiting for it (idempotent): it imports and loads its reward model
        while the caller goes on (the trainer loads the policy meanwhile); ``start`` then waits."""
        if self.proc is not None:
            return
        fd, log = tempfile.mkstemp(prefix="rallyrl-reward-server-", suffix=".log")
        self._log = Path(log)
        env = dict(os.environ)
        # The same import resolution as this process (a test's or notebook's sys.path included).
        paths = [p for p in sys.path if p and os.path.isdir(p)]
        env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        me = os.getpid()
        try:
            self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=fd, stderr=fd, env=env,
                                         start_new_session=True, preexec_fn=lambda: _die_with_parent(me))
        finally:
            os.close(fd)

    def _wait_ready(self, deadline: float) -> str:
        import http.client

        assert self.proc is not None and self._log is not None
        url: str | None = None
        while True:
            code = self.proc.poll()
            if code is not None:
                raise LocalServerError(f"reward.server: local: `rallyrl serve-reward --fn {self.fn}` exited with "
                                       f"code {code} before it was ready; its output:\n{self.output_tail()}")
            if url is None:
                for line in self._log.read_text(errors="replace").splitlines():
                    if line.startswith("rallyrl serve-reward: ") and " on http://" in line:
                        url = line.split(" on ", 1)[1].split(" ", 1)[0]
            if url is not None:
                # the socket is bound before uvicorn serves: ready when /health answers
                host_port = url.removeprefix("http://")
                try:
                    conn = http.client.HTTPConnection(host_port, timeout=1)
                    conn.request("GET", "/health")
                    if conn.getresponse().status == 200:
                        conn.close()
                        return url
                    conn.close()
                except OSError:
                    pass
            if time.monotonic() > deadline:
                raise LocalServerError(f"reward.server: local: `rallyrl serve-reward --fn {self.fn}` did not answer "
                                       f"within {self.startup_timeout_s:g} s; its output:\n{self.output_tail()}")
            time.sleep(_POLL_S)

    def output_tail(self, chars: int = 3000) -> str:
        try:
            return self._log.read_text(errors="replace")[-chars:].rstrip() if self._log else ""
        except OSError:
            return ""

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM (uvicorn shuts down gracefully), SIGKILL after ``timeout_s``; then wait for it."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._log is not None:
            self._log.unlink(missing_ok=True)
            self._log = None
