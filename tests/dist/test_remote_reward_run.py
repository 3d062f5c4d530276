"""Training against a real `rallyrl serve-reward` process (2 ranks, gloo): the final weights are the
same bytes as the in-process `main` placement run with the same config —

- with `main` and `local` placement pointed at a server the test started (`local`: both ranks' requests
  reach the one server), synchronous;
- with `reward.server: local` (rank 0 starts the server itself) and `reward.overlap: true` (each chunk
  round scored in the background while the ranks generate the next; 2 rounds per iteration here), so
  overlap == synchronous == in-process; the server process is gone after the run.

And the failures, each seen on EVERY rank (tests/helpers/train_worker.py records how `train` ended on
each): the server killed mid-run under overlap -> the same RewardError naming the URL; an in-process
reward slower than `reward.timeout_s` -> the same RewardError naming `reward.timeout_s`, within seconds
(the reward would sleep for minutes), with the "waiting for the reward on rank 0" progress line first.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")

from rallyrl.run.logs import read_jsonl  # noqa: E402
from tests.helpers.reward_servers import serve_reward_process, stop  # noqa: E402
from tests.helpers.runs import ROOT, base_config, env, rallyrl_train, write_config  # noqa: E402

pytestmark = pytest.mark.dist


def _train(tmp, name, model, reward, **env_extra):
    cfg = base_config(model, tmp / name)
    cfg["reward"] = reward
    cfg["dist"] = {"timeout_s": 120}
    proc = rallyrl_train(write_config(tmp / f"{name}.yaml", cfg), 2, **env_extra)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return (tmp / name / "final" / "model.safetensors").read_bytes()


@pytest.fixture(scope="module")
def in_process(tiny_model, tmp_path_factory):
    """Final weights of the in-process `main` run: the reference every other run must reproduce."""
    return _train(tmp_path_factory.mktemp("in-process"), "in-process", tiny_model,
                  {"fn": "tests.helpers.rewards:hashed", "placement": "main"})


def test_two_process_training_against_the_server_equals_in_process_main(tiny_model, tmp_path, in_process):
    proc, url = serve_reward_process("--fn", "tests.helpers.rewards:hashed", "--max-wait-ms", "20")
    try:
        remote_main = _train(tmp_path, "remote-main", tiny_model, {"url": url, "placement": "main"})
        remote_local = _train(tmp_path, "remote-local", tiny_model, {"url": [url], "placement": "local",
                                                                     "retries": 1})
        import httpx

        health = httpx.get(url + "/health").json()
    finally:
        stop(proc)
    assert remote_main == in_process
    assert remote_local == in_process
    # the server scored every sample of both remote runs exactly once: 2 runs x 2 iterations x 7 rollouts
    assert health["samples"] == 2 * 2 * 7 and health["errors"] == 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped) is gone for every purpose here
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_local_server_with_overlap_equals_in_process_main_and_is_gone_afterwards(tiny_model, tmp_path, in_process):
    log = tmp_path / "calls.jsonl"
    weights = _train(tmp_path, "server-local", tiny_model,
                     {"fn": "tests.helpers.rewards:hashed", "server": "local", "overlap": True,
                      "server_args": ["--max-wait-ms", "20"]}, RALLYRL_TEST_CALL_LOG=str(log))
    assert weights == in_process
    calls = read_jsonl(log)
    # every call was made by one serve-reward process (rank 0's child), never by a trainer rank, and it
    # scored each of the 2 iterations x 7 rollouts exactly once
    assert {c["command"] for c in calls} == {"serve-reward"} and len({c["pid"] for c in calls}) == 1
    assert sum(c["n"] for c in calls) == 2 * 7
    assert not _alive(calls[0]["pid"]), "the reward server outlived the run"
    rows = read_jsonl(tmp_path / "server-local" / "metrics.jsonl")
    # with overlap the main rank only waits in the one collect per iteration
    assert all(0 <= m["time/reward_wait"] for m in rows) and all("time/reward" in m for m in rows)


def _torchrun(tmp: Path, cfg: dict, timeout: float = 180, **env_extra) -> tuple[subprocess.Popen, Path]:
    out = tmp / "ranks"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / "helpers" / "train_worker.py"), str(write_config(tmp / "c.yaml", cfg)), str(out)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env(**env_extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    return proc, out


def _ranks(out: Path) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_a_server_killed_mid_run_under_overlap_ends_every_rank_with_the_url(tiny_model, tmp_path):
    server, url = serve_reward_process("--fn", "tests.helpers.rewards:hashed_slow",
                                       RALLYRL_TEST_REWARD_SLEEP="0.2")
    try:
        cfg = base_config(tiny_model, tmp_path / "run", train={"iterations": 8})
        cfg["reward"] = {"url": url, "overlap": True, "retries": 1, "timeout_s": 5}
        cfg["dist"] = {"timeout_s": 300}  # a rank left waiting in a collective would hang for minutes
        proc, out = _torchrun(tmp_path, cfg)
        metrics = tmp_path / "run" / "metrics.jsonl"
        deadline = time.monotonic() + 150
        while not (metrics.exists() and metrics.read_text().strip()):  # the first iteration is logged
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.05)
        server.send_signal(signal.SIGKILL)
        killed = time.time()
        _, stderr = proc.communicate(timeout=150)
    finally:
        stop(server)
    ranks = _ranks(out)
    for r in ranks:
        assert r["type"] == "RewardError", (r, stderr[-3000:])
        assert f"reward server {url}/score: gave up after 2 attempt(s)" in r["message"], r["message"]
    assert ranks[0]["message"] == ranks[1]["message"]
    print(f"\nkilled -> every rank stopped {max(r['end'] for r in ranks) - killed:.1f} s later")


def test_an_in_process_reward_past_reward_timeout_s_ends_every_rank(tiny_model, tmp_path):
    cfg = base_config(tiny_model, tmp_path / "run")
    cfg["reward"] = {"fn": "tests.helpers.rewards:slow_hashed", "timeout_s": 1.5}
    cfg["dist"] = {"timeout_s": 300}
    # the reward would sleep 120 s; the notice threshold is lowered so the progress line shows up first
    proc, out = _torchrun(tmp_path, cfg, RALLYRL_TEST_SLEEP="120", RALLYRL_WAIT_NOTICE_S="0.3")
    _, stderr = proc.communicate(timeout=170)
    ranks = _ranks(out)
    for r in ranks:
        assert r["type"] == "RewardError", (r, stderr[-3000:])
        assert "reward function 'slow_hashed' did not return within reward.timeout_s=1.5 s" in r["message"], r
        assert r["message"].startswith("reward step failed on rank 0: RewardTimeoutError")
        # it ended long before the sleeping reward could have returned (the run does not wait for it)
        assert r["end"] - r["start"] < 100
    assert "rallyrl: waiting for the reward on rank 0, 0 s" in stderr, stderr[-3000:]


def test_ctrl_c_stops_the_local_server_too(tiny_model, tmp_path):
    """SIGINT to the `rallyrl train --nproc 2` launcher mid-run (what a terminal's Ctrl-C sends): every
    rank stops with the interrupted line, and rank 0's reward server does not outlive the run."""
    log = tmp_path / "calls.jsonl"
    cfg = base_config(tiny_model, tmp_path / "run", train={"iterations": 50})
    cfg["reward"] = {"fn": "tests.helpers.rewards:hashed_slow", "server": "local", "overlap": True}
    cfg["dist"] = {"timeout_s": 120}
    cmd = [sys.executable, "-m", "rallyrl.cli", "train", str(write_config(tmp_path / "c.yaml", cfg)), "--nproc", "2"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env(RALLYRL_TEST_CALL_LOG=str(log), RALLYRL_TEST_REWARD_SLEEP="0.3"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 150
    while not (log.exists() and log.read_text().strip()):  # the server is up and scoring
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=90)
    assert proc.returncode == 130, stderr[-3000:]
    assert "rallyrl: interrupted at iteration" in stderr, stderr[-3000:]
    pids = {c["pid"] for c in read_jsonl(log)}
    assert {c["command"] for c in read_jsonl(log)} == {"serve-reward"} and len(pids) == 1
    assert not _alive(pids.pop()), "the reward server outlived the interrupted run"
