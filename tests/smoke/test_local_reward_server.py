"""`reward.server: local`'s process handling (rallyrl.reward.local_server), with real `rallyrl serve-reward`
processes: it starts on a free loopback port and answers; a server that cannot start is an error carrying
its own output; stop() leaves no process; and a parent killed with SIGKILL (no `finally` runs) still
takes its server with it (PR_SET_PDEATHSIG)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

pytest.importorskip("fastapi")

from rallyrl.reward.local_server import LocalRewardServer, LocalServerError  # noqa: E402
from tests.helpers.rewards import deterministic_score  # noqa: E402
from tests.helpers.runs import ROOT, env  # noqa: E402

pytestmark = pytest.mark.smoke


def _gone(pid: int, within_s: float = 15.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = open(f"/proc/{pid}/stat").read().split(")")[-1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


def test_start_answer_stop():
    from rallyrl.reward import RemoteReward

    server = LocalRewardServer("tests.helpers.rewards:hashed", extra_args=["--max-wait-ms", "0"])
    try:
        url = server.start()
        assert url.startswith("http://127.0.0.1:") and server.running
        remote = RemoteReward(url, retries=0)
        assert remote(["a b", "c d"], ["a", "c"], [" b", " d"], output_token_ids=[[1], [2]]) == [
            deterministic_score("a", " b"), deterministic_score("c", " d")]
        remote.close()
        pid = server.proc.pid
    finally:
        server.stop()
    assert not server.running and _gone(pid)
    server.stop()  # idempotent


def test_a_server_that_cannot_start_is_an_error_with_its_output():
    server = LocalRewardServer("tests.helpers.rewards:no_such_fn")
    with pytest.raises(LocalServerError, match=r"(?s)exited with code 2 before it was ready.*has no attribute "
                                                r"'no_such_fn'"):
        server.start()
    assert server.proc is None


def test_the_server_dies_with_a_killed_parent():
    code = ("import os, signal\n"
            "from rallyrl.reward.local_server import LocalRewardServer\n"
            "s = LocalRewardServer('tests.helpers.rewards:hashed')\n"
            "s.start()\n"
            "print(s.proc.pid, flush=True)\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n")
    parent = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env(), capture_output=True, text=True,
                            timeout=120)
    assert parent.returncode == -9, parent.stderr[-2000:]
    pid = int(parent.stdout.strip())
    assert _gone(pid), "the reward server outlived its SIGKILLed parent"


@pytest.mark.parametrize("overlap", [False, True])
def test_a_local_server_that_died_is_named_in_the_reward_error(overlap):
    from rallyrl.reward import NamedRewardFn, RewardError, RewardStep, Samples
    from tests.helpers.rewards import hashed

    server = LocalRewardServer("tests.helpers.rewards:hashed")
    step = RewardStep([NamedRewardFn("hashed", hashed)], "main", overlap=overlap, server=server,
                      remote_options={"retries": 0, "timeout_s": 5})
    try:
        step.open()
        s = Samples(["a"], [" b"], [[1]], [{}])
        (rewards, _), = step.collect([step.submit(s)])
        assert [r.score for r in rewards] == [deterministic_score("a", " b")]
        server.proc.kill()
        server.proc.wait()
        with pytest.raises(RewardError, match=r"(?s)RemoteRewardError: reward server http://127.0.0.1:\d+/score: "
                                              r"gave up.*the reward.server: local process has exited with code -9"):
            step.collect([step.submit(s)])
    finally:
        step.close()
    assert server.proc is None


def _server_children() -> list[int]:
    """Pids of this process's children that run `rallyrl serve-reward`."""
    import os

    out = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().split(")")[-1].split()[1])
            cmd = open(f"/proc/{pid}/cmdline").read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == os.getpid() and "serve-reward" in cmd:
            out.append(int(pid))
    return out


def test_train_spawns_the_server_before_loading_and_stops_it_when_loading_fails(tiny_model, tmp_path, monkeypatch):
    """`reward.server: local` is spawned before the models load (it starts up meanwhile); a start-up
    that fails after that (here: loading the models raises) leaves no server process behind."""
    import rallyrl
    import rallyrl.trainer
    from tests.helpers.runs import base_config

    seen = []
    real_build = rallyrl.trainer._build

    def failing_build(*args, **kwargs):
        seen.extend(_server_children())  # already spawned while the models would load
        real_build(*args, **kwargs)
        raise RuntimeError("injected: loading failed")

    monkeypatch.setattr(rallyrl.trainer, "_build", failing_build)
    cfg = base_config(tiny_model, tmp_path / "run", reward={"server": "local"})
    with pytest.raises(RuntimeError, match="injected"):
        rallyrl.train(cfg)
    assert len(seen) == 1
    assert _gone(seen[0]), "the reward server outlived the failed start-up"
