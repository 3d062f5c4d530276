"""The reward step with REAL collectives (3 processes, gloo), without training: random per-rank counts
(zeros included), every placement and micro-batch size, RNG isolation on every rank, and collective
failure (each failing case is followed by a successful step: no rank was left inside a collective).

pytest launches this file as a torch.distributed.run worker (``python -m torch.distributed.run
--nproc_per_node 3 THIS_FILE OUT``); the worker asserts and writes what it measured to OUT.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist

NPROC = 3


def test_reward_step_with_real_collectives(tmp_path):
    from tests.helpers.runs import ROOT, env

    out = tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={NPROC}",
           str(Path(__file__).resolve()), str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    res = json.loads((out / "result.json").read_text())
    assert res["trials"] >= 30 and res["rounds_with_an_empty_rank"] > 0
    # every failure case: all ranks raised the same RewardError, within seconds (timeout is 60 s)
    assert set(res["failures"]) == {"main-raises", "main-invalid", "local-raises-on-1", "local-nan-on-2",
                                    "collective-raises-on-1", "collective-invalid"}
    for case, seconds in res["failures"].items():
        assert seconds < 10, (case, seconds)


# ------------------------------------------------------------------------------------------------
# The worker (runs in each of the NPROC processes)


def _worker(out: Path) -> None:
    import numpy as np
    import torch
    import torch.distributed as tdist  # the reward functions below are user code (a sharded model)

    from rallyrl import dist
    from rallyrl.reward import NamedRewardFn, RewardError, RewardStep, Samples, micro_batches
    from rallyrl.seeding import get_rng_state
    from tests.helpers.rewards import draw_from_global_rngs

    torch.set_num_threads(1)
    dist.init_accelerator(timeout_s=60)
    W, R = dist.world_size(), dist.rank()
    assert W == NPROC

    def shard(n: int) -> Samples:
        return Samples([f"r{R}s{j}|" for j in range(n)], [f"o{j}" for j in range(n)],
                       [list(range(1 + j % 3)) for j in range(n)], [{"tag": [R, j]} for j in range(n)])

    def value(tag) -> float:
        return 1000.0 * tag[0] + tag[1]

    seen: list = []  # tags in the order this rank's reward function saw them

    def tagged(samples, prompts, outputs, **kw):
        draw_from_global_rngs()
        seen.extend(tuple(t) for t in kw["tag"])
        return [value(t) for t in kw["tag"]]

    def sharded(samples, prompts, outputs, **kw):  # computes 1/W of the batch, all-reduce combines
        draw_from_global_rngs()
        seen.extend(tuple(t) for t in kw["tag"])
        part = torch.zeros(len(samples), dtype=torch.float64)
        for i, t in enumerate(kw["tag"]):
            if i % W == R:
                part[i] = value(t)
        tdist.all_reduce(part)
        return part.tolist()

    def same_rng(a, b) -> bool:
        return (a["python"] == b["python"] and torch.equal(a["torch"], b["torch"])
                and all(np.array_equal(x, y) for x, y in zip(a["numpy"], b["numpy"])))

    rng = np.random.default_rng(2024)  # same stream on every rank: all agree on the counts
    trials = empty = 0
    for _ in range(12):
        counts = [int(c) for c in rng.integers(0, 5, size=W)]
        bs = [None, 1, 2, 3, 5][int(rng.integers(0, 5))]
        empty += any(c == 0 for c in counts)
        n = sum(counts)
        for placement in ("main", "local", "collective"):
            fn = sharded if placement == "collective" else tagged
            seen.clear()
            before = get_rng_state()
            rewards, stats = RewardStep([NamedRewardFn(placement, fn)], placement, bs)(shard(counts[R]))
            assert same_rng(before, get_rng_state()), placement
            assert [rw.score for rw in rewards] == [value([R, j]) for j in range(counts[R])], (placement, counts)
            global_order = [(r, j) for r in range(W) for j in range(counts[r])]
            if placement == "main":
                assert seen == (global_order if R == 0 else []), (seen, counts)
            elif placement == "local":
                assert seen == [(R, j) for j in range(counts[R])]
            else:
                assert seen == global_order
            calls, samples = (sum(x) for x in zip(*dist.all_gather_objects((stats.calls, stats.samples))))
            expected_calls = (sum(len(micro_batches(c, bs)) for c in counts) if placement == "local"
                              else len(micro_batches(n, bs)))
            assert (calls, samples) == (expected_calls, n), (placement, counts, bs, calls, samples)
            trials += 1

    # -- failures: every rank raises the same RewardError, then the group is still usable
    def raises(rank):
        def failing_reward(samples, prompts, outputs, **kw):
            if R == rank:
                raise ValueError(f"boom on rank {R}")
            return [0.0] * len(samples)
        return failing_reward

    def short(samples, prompts, outputs, **kw):
        return [0.0] * (len(samples) - 1)

    def nan_on_2(samples, prompts, outputs, **kw):
        return [math.nan if R == 2 and i == 1 else 0.0 for i in range(len(samples))]

    def sharded_then_raises_on_1(samples, prompts, outputs, **kw):
        x = torch.ones(1)
        tdist.all_reduce(x)  # the joint forward completes, then rank 1 fails on its part
        if R == 1:
            raise RuntimeError("shard 1 post-processing failed")
        return [float(x)] * len(samples)

    cases = {
        "main-raises": ("main", raises(0), "on rank 0: ValueError: boom on rank 0", 0),
        "main-invalid": ("main", short, "on rank 0: RewardValidationError: reward function 'main-invalid': "
                                        "expected 6 rewards, got 5", 0),
        "local-raises-on-1": ("local", raises(1), "on rank 1: ValueError: boom on rank 1", 1),
        "local-nan-on-2": ("local", nan_on_2, "on rank 2: RewardValidationError: reward function "
                                              "'local-nan-on-2': sample 1: reward is nan", 2),
        "collective-raises-on-1": ("collective", sharded_then_raises_on_1,
                                   "on rank 1: RuntimeError: shard 1 post-processing failed", 1),
        "collective-invalid": ("collective", short, "on rank 0: RewardValidationError", 0),
    }
    timings = {}
    for name, (placement, fn, expected, failing_rank) in cases.items():
        dist.barrier()
        t0 = time.perf_counter()
        try:
            RewardStep([NamedRewardFn(name, fn)], placement)(shard(2))
        except RewardError as e:
            err = e
        else:
            raise AssertionError(f"{name}: no RewardError on rank {R}")
        elapsed = time.perf_counter() - t0
        assert expected in str(err), (name, str(err))
        assert "Traceback (most recent call last)" in str(err) and err.rank == failing_rank
        messages = dist.all_gather_objects(str(err))
        assert len(set(messages)) == 1, f"{name}: ranks raised different errors"
        timings[name] = max(dist.all_gather_objects(elapsed))
        # the process group is healthy: nobody is still waiting inside the failed step
        rewards, _ = RewardStep([NamedRewardFn("ok", tagged)], placement)(shard(1))
        assert [rw.score for rw in rewards] == [value([R, 0])]

    if R == 0:
        (out / "result.json").write_text(json.dumps({"trials": trials, "rounds_with_an_empty_rank": empty,
                                                     "failures": timings}))
    dist.barrier()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    _worker(Path(sys.argv[1]))
    # Leave as rallyrl's own workers do: every rank leaves the group together, then the process ends
    # without interpreter teardown, where gloo/store threads occasionally abort a finished worker
    # ("terminate called without an active exception", exit 134) after every assertion passed.
    from rallyrl import dist as _dist

    _dist.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
