"""Overlap at the RewardStep level: ``submit`` (returns at once; the main rank's background thread talks
to the reward server) and ``collect`` (waits, validates, scatters once), in 1 process and with 2 real
processes (gloo): same rewards as the synchronous step, global RNG streams untouched while requests are
in flight, failures collective with their cause, the group usable afterwards. Also ``reward.timeout_s``
bounding an in-process reward call (``main`` and ``local``): every rank raises the RewardError naming it.

The reward server is a real uvicorn server on a random loopback port in the pytest process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")

pytestmark = pytest.mark.dist

NPROC = 2


def _shard(rank: int, n: int, tag: str = ""):
    from rallyrl.reward import Samples

    return Samples([f"{tag}r{rank}s{j} " for j in range(n)], [f"o{j}" * (1 + j % 2) for j in range(n)],
                   [list(range(1 + j % 3)) for j in range(n)], [{"id": [rank, j]} for j in range(n)])


def _want(samples):
    from tests.helpers.rewards import deterministic_score

    return [deterministic_score(p, o) for p, o in zip(samples.prompts, samples.outputs)]


def test_submit_returns_at_once_and_collect_matches_the_synchronous_step():
    from rallyrl.reward import NamedRewardFn, RemoteReward, RewardError, RewardStep
    from rallyrl.seeding import get_rng_state
    from tests.helpers.reward_servers import ScriptedServer

    with ScriptedServer(default="gate") as srv:  # every request is held until the gate opens
        step = RewardStep([NamedRewardFn("remote", RemoteReward(srv.url, retries=0))], "main", overlap=True)
        rounds = [_shard(0, n, tag=f"t{k}") for k, n in enumerate([3, 0, 2, 4])]
        before = get_rng_state()
        handles = [step.submit(s) for s in rounds]
        time.sleep(0.2)
        assert not any(h.future.done() for h in handles if h.n)  # held by the server: submit did not wait
        srv.gate.set()
        out = step.collect(handles)
        after = get_rng_state()
        assert before["python"] == after["python"] and (before["torch"] == after["torch"]).all()
        assert [[rw.score for rw in r] for r, _ in out] == [_want(s) for s in rounds]
        sync = [step(s)[0] for s in rounds]
        assert [[rw.score for rw in r] for r in sync] == [[rw.score for rw in r] for r, _ in out]
        # the same API without overlap: each submit is the synchronous step, collect hands the results back
        plain = RewardStep(step.fns, "main")
        plain_out = plain.collect([plain.submit(s) for s in rounds])
        assert [[rw.score for rw in r] for r, _ in plain_out] == [[rw.score for rw in r] for r, _ in out]
        assert [st.samples for _, st in out] == [3, 0, 2, 4] and out[-1][1].time_wait >= 0
        step.close()

    with ScriptedServer(default="500") as srv:  # a failing round: RewardError carrying the server's cause
        step = RewardStep([NamedRewardFn("remote", RemoteReward(srv.url, retries=0))], "main", overlap=True)
        with pytest.raises(RewardError, match=r"RemoteRewardError: reward server .*HTTP 500: scripted failure"):
            step.collect([step.submit(_shard(0, 2)), step.submit(_shard(0, 1))])
        step.close()


def test_overlap_needs_main_placement_and_remote_functions():
    from rallyrl.reward import NamedRewardFn, RemoteReward, RewardStep
    from tests.helpers.rewards import hashed

    with pytest.raises(ValueError, match=r"remote reward functions .*\['hashed'\]"):
        RewardStep([NamedRewardFn("hashed", hashed)], "main", overlap=True)
    with pytest.raises(ValueError, match="placement 'main', not 'local'"):
        RewardStep([NamedRewardFn("r", RemoteReward("http://127.0.0.1:9"))], "local", overlap=True)


def test_overlap_with_two_processes(tmp_path):
    from tests.helpers.reward_servers import ScriptedServer
    from tests.helpers.runs import ROOT, env

    with ScriptedServer() as good, ScriptedServer(default="500") as bad:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={NPROC}",
               str(Path(__file__).resolve()), str(tmp_path), good.url, bad.url]
        proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        res = json.loads((tmp_path / "result.json").read_text())
        assert res["trials"] == 6 and res["empty_rounds"] > 0
        assert res["failure_seconds"] < 10
        # only rank 0 talked to the server: one request per submitted non-empty round
        assert len(good.requests) == res["nonempty_rounds"]


def _worker(out: Path, url: str, bad_url: str) -> None:
    import numpy as np
    import torch

    from rallyrl import dist
    from rallyrl.reward import NamedRewardFn, RemoteReward, RewardError, RewardStep
    from rallyrl.seeding import get_rng_state

    torch.set_num_threads(1)
    dist.init_accelerator(timeout_s=60)
    W, R = dist.world_size(), dist.rank()
    step = RewardStep([NamedRewardFn("remote", RemoteReward(url, retries=1, backoff_s=0.05))], "main", overlap=True)
    rng = np.random.default_rng(7)  # same stream on every rank: all agree on the counts
    trials = empty = nonempty = 0
    for t in range(6):
        counts = [[int(c) for c in rng.integers(0, 4, size=W)] for _ in range(4)]  # 4 rounds
        empty += sum(1 for c in counts if sum(c) == 0)
        nonempty += sum(1 for c in counts if sum(c) > 0)
        rounds = [_shard(R, c[R], tag=f"t{t}k{k}") for k, c in enumerate(counts)]
        torch.manual_seed(100 + t)
        expect_draws = torch.rand(4).tolist()  # what the training stream gives without reward traffic
        torch.manual_seed(100 + t)
        before = get_rng_state()
        handles, draws = [], []
        for s in rounds:
            handles.append(step.submit(s))
            draws.append(torch.rand(1).item())  # "generation" goes on while requests are in flight
        results = step.collect(handles)
        assert draws == expect_draws, "the background reward traffic moved the training RNG"
        assert get_rng_state()["python"] == before["python"]
        for s, (rewards, st) in zip(rounds, results):
            assert [rw.score for rw in rewards] == _want(s), (t, counts)
        samples = sum(st.samples for _, st in results)
        total = sum(x for x in dist.all_gather_objects(samples))
        assert total == sum(sum(c) for c in counts)
        trials += 1

    failing = RewardStep([NamedRewardFn("remote", RemoteReward(bad_url, retries=0))], "main", overlap=True)
    t0 = time.perf_counter()
    try:
        failing.collect([failing.submit(_shard(R, 2)), failing.submit(_shard(R, 1))])
        raise AssertionError("no RewardError")
    except RewardError as e:
        assert "HTTP 500: scripted failure" in str(e) and e.rank == 0, str(e)
    failure_seconds = time.perf_counter() - t0
    (rewards, _), = step.collect([step.submit(_shard(R, 1, tag="after"))])  # the group is still usable
    assert [rw.score for rw in rewards] == _want(_shard(R, 1, tag="after"))
    nonempty += 1
    step.close()

    # reward.timeout_s bounds in-process calls: the slow rank times out, every rank raises, then the
    # group is still usable
    def slow_on(rank):
        def slow_reward(samples, prompts, outputs, **kw):
            if R == rank:
                time.sleep(2)
            return [0.0] * len(samples)
        return slow_reward

    for placement, rank in (("main", 0), ("local", 1)):
        t0 = time.perf_counter()
        try:
            RewardStep([NamedRewardFn("slow", slow_on(rank))], placement, timeout_s=0.5)(_shard(R, 2))
            raise AssertionError("no RewardError")
        except RewardError as e:
            assert e.rank == rank and "did not return within reward.timeout_s=0.5 s" in str(e), str(e)
        assert time.perf_counter() - t0 < 4, placement
    fast_step = RewardStep([NamedRewardFn("ok", lambda s, p, o, **kw: [1.0] * len(s))], "main", timeout_s=5)
    assert [rw.score for rw in fast_step(_shard(R, 2))[0]] == [1.0, 1.0]
    # The overrun calls are still running on daemon threads: let them end before the interpreter does (a
    # daemon thread inside torch's C++ code at interpreter shutdown can abort the process).
    import threading

    for t in threading.enumerate():
        if t.name == "rallyrl-reward-call":
            t.join(timeout=10)
    failing.close()
    if R == 0:
        (out / "result.json").write_text(json.dumps({"trials": trials, "empty_rounds": empty,
                                                     "nonempty_rounds": nonempty,
                                                     "failure_seconds": failure_seconds}))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    _worker(Path(sys.argv[1]), sys.argv[2], sys.argv[3])
    # Leave as rallyrl's own workers do: every rank leaves the group together, then the process ends
    # without interpreter teardown, where gloo/store threads occasionally abort a finished worker
    # ("terminate called without an active exception", exit 134) after every assertion passed.
    from rallyrl import dist as _dist

    _dist.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
