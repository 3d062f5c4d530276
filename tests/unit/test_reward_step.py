"""The reward step in one process: ordering logic (property-based), combination of weighted and dense
rewards, metadata columns, RNG isolation (and a proof that the check can fail), failure wrapping.

The same step with real collectives (2-3 processes, gloo) is tested in tests/dist/test_reward_*.py.
"""

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rallyrl.reward import (NamedRewardFn, RewardError, RewardStep, Samples, concat_shards, micro_batches,
                            split_by_counts)
from rallyrl.reward.step import score_samples
from rallyrl.seeding import get_rng_state, isolated_rng
from tests.helpers.rewards import draw_from_global_rngs, hashed, hashed_noisy


def shard(rank: int, n: int) -> Samples:
    """Rank `rank`'s n samples, each tagged (rank, j) in prompt, output, token ids and metadata."""
    return Samples([f"r{rank}s{j}|" for j in range(n)], [f"out{rank}.{j}" for j in range(n)],
                   [[rank, j, 0][: 1 + (j % 3)] for j in range(n)], [{"tag": (rank, j)} for j in range(n)])


@settings(max_examples=200, deadline=None)
@given(counts=st.lists(st.integers(0, 9), min_size=1, max_size=8),
       batch_size=st.one_of(st.none(), st.integers(1, 12)))
def test_gather_score_scatter_gives_every_rank_its_own_rewards_in_order(counts, batch_size):
    """What `main` and `collective` do, without processes: concatenate the shards in rank order, score
    in micro-batches, split by counts. Every rank gets exactly its own rewards, in its own order; the
    reward function saw the samples in global (rank-major) order, in calls of at most batch_size."""
    shards = [shard(r, c) for r, c in enumerate(counts)]
    batch, got_counts = concat_shards(shards)
    assert got_counts == counts
    expected_order = [(r, j) for r, c in enumerate(counts) for j in range(c)]
    seen, sizes = [], []

    def fn(samples, prompts, outputs, **kw):
        seen.extend(kw["tag"])
        sizes.append(len(samples))
        assert kw["output_token_ids"] == [[t[0], t[1], 0][: len(o)] for t, o in zip(kw["tag"], kw["output_token_ids"])]
        # scalar for even j, dense (one value per token) for odd j: a mixed return
        return [100 * r + j if j % 2 == 0 else [100 * r + j] * len(ids)
                for (r, j), ids in zip(kw["tag"], kw["output_token_ids"])]

    rewards, stats = score_samples([NamedRewardFn("f", fn)], batch, None, batch_size)
    per_rank = split_by_counts(rewards, counts)
    assert seen == expected_order
    n = sum(counts)
    bs = batch_size or n
    assert sizes == [min(bs, n - a) for a in range(0, n, bs)] if n else sizes == []
    assert stats.calls == len(sizes) == len(micro_batches(n, batch_size)) == (-(-n // bs) if n else 0)
    assert stats.samples == n
    for r, mine in enumerate(per_rank):
        assert len(mine) == counts[r]
        for j, rw in enumerate(mine):
            if j % 2 == 0:
                assert rw.score == 100 * r + j and rw.dense is None
            else:
                assert rw.score == 0 and rw.dense == [100 * r + j] * len(shards[r].output_token_ids[j])
    # collective: each rank keeps split_by_counts(...)[rank]; local: each rank scores only its shard
    for r in range(len(counts)):
        alone, _ = score_samples([NamedRewardFn("f", fn)], shards[r], None, batch_size)
        assert [x.total for x in alone] == [x.total for x in per_rank[r]]


@given(counts=st.lists(st.integers(0, 5), min_size=1, max_size=6))
def test_split_is_the_inverse_of_concat(counts):
    items = list(range(sum(counts)))
    parts = split_by_counts(items, counts)
    assert [len(p) for p in parts] == counts and [x for p in parts for x in p] == items


def test_split_rejects_wrong_counts():
    with pytest.raises(ValueError, match=r"cannot split 3 items into per-rank counts \[1, 1\]"):
        split_by_counts([1, 2, 3], [1, 1])


def test_micro_batches():
    assert micro_batches(7, 3) == [(0, 3), (3, 6), (6, 7)]  # 7 samples, batch_size 3 -> 3 calls
    assert micro_batches(7, None) == [(0, 7)]
    assert micro_batches(0, 3) == []
    assert micro_batches(2, 8) == [(0, 2)]


def test_weighted_functions_and_dense_combine_and_keep_their_pieces():
    s = shard(0, 4)

    def a(samples, prompts, outputs, **kw):
        return [j + 1.0 for _, j in kw["tag"]]

    def b(samples, prompts, outputs, **kw):  # dense, shorter than the output for sample 2
        return [[0.5] * len(ids) if j != 2 else [1.0] for (_, j), ids in zip(kw["tag"], kw["output_token_ids"])]

    rewards, stats = score_samples([NamedRewardFn("a", a, 0.5), NamedRewardFn("b", b, 2.0)], s, None, 3)
    assert stats.calls == 4 and stats.samples == 8  # 2 functions x ceil(4/3) calls
    lens = [len(t) for t in s.output_token_ids]  # [1, 2, 3, 1]
    for i, rw in enumerate(rewards):
        assert rw.score == 0.5 * (i + 1)
        dense_b = [0.5] * lens[i] if i != 2 else [1.0]
        assert rw.dense == [2.0 * x for x in dense_b] + [0.0] * (lens[i] - len(dense_b))
        assert rw.components == {"a": i + 1.0, "b": sum(dense_b)}  # unweighted pieces
        assert rw.total == pytest.approx(0.5 * rw.components["a"] + 2.0 * rw.components["b"])


def test_metadata_columns_are_per_sample_lists_and_missing_values_are_none():
    s = Samples(["p0", "p1", "p2"], ["a", "b", "c"], [[1], [2], [3]],
                [{"expected_prompt": "p0", "x": 1}, {"expected_prompt": "p1"}, {"expected_prompt": "p2", "y": 2}])
    seen = {}

    def fn(samples, prompts, outputs, **kw):
        seen.update(kw)
        return hashed(samples, prompts, outputs, **kw)  # asserts expected_prompt is aligned

    RewardStep([NamedRewardFn("fn", fn)], "main", tokenizer="TOK")(s)
    assert seen["x"] == [1, None, None] and seen["y"] == [None, None, 2]
    assert seen["output_token_ids"] == [[1], [2], [3]] and seen["tokenizer"] == "TOK"


# ------------------------------------------------------------------------------------------------
# RNG isolation


def _next_draws():
    return (random.random(), float(np.random.rand()), float(torch.rand(1)))


def test_without_isolation_the_global_streams_move():
    """The check below CAN fail: a reward function that draws random numbers, called directly, moves
    every global stream, so the training draws that follow change."""
    torch.manual_seed(0); np.random.seed(0); random.seed(0)
    reference = _next_draws()
    torch.manual_seed(0); np.random.seed(0); random.seed(0)
    hashed_noisy(["ab"], ["a"], ["b"], output_token_ids=[[1]])
    moved = _next_draws()
    assert all(x != y for x, y in zip(reference, moved))  # python, numpy and torch all moved


@pytest.mark.parametrize("placement", ["main", "local", "collective"])
@pytest.mark.parametrize("batch_size", [None, 2])
def test_reward_step_leaves_every_global_stream_untouched(placement, batch_size):
    torch.manual_seed(0); np.random.seed(0); random.seed(0)
    reference = _next_draws()
    torch.manual_seed(0); np.random.seed(0); random.seed(0)
    before = get_rng_state()
    rewards, stats = RewardStep([NamedRewardFn("noisy", hashed_noisy)], placement, batch_size)(shard(0, 5))
    assert stats.calls == (1 if batch_size is None else 3)
    after = get_rng_state()
    assert after["python"] == before["python"]
    assert all((a == b).all() if isinstance(a, np.ndarray) else a == b
               for a, b in zip(after["numpy"], before["numpy"]))
    assert torch.equal(after["torch"], before["torch"])
    assert _next_draws() == reference


def test_isolated_rng_restores_even_when_the_block_raises():
    torch.manual_seed(1)
    state = torch.get_rng_state()
    with pytest.raises(ZeroDivisionError):
        with isolated_rng():
            draw_from_global_rngs()
            1 / 0
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_isolated_rng_covers_cuda():
    torch.cuda.manual_seed_all(0)
    ref = torch.rand(3, device="cuda")
    torch.cuda.manual_seed_all(0)
    with isolated_rng():
        torch.rand(10, device="cuda")
    assert torch.equal(torch.rand(3, device="cuda"), ref)


# ------------------------------------------------------------------------------------------------
# Failure wrapping (world size 1; the multi-process behaviour is in tests/dist)


@pytest.mark.parametrize("placement", ["main", "local", "collective"])
def test_an_exception_becomes_a_reward_error_with_message_and_traceback(placement):
    def broken_reward(samples, prompts, outputs, **kw):
        raise KeyError("no such column 'label'")

    with pytest.raises(RewardError) as e:
        RewardStep([NamedRewardFn("broken", broken_reward)], placement)(shard(0, 3))
    msg = str(e.value)
    assert msg.startswith("reward step failed on rank 0: KeyError: \"no such column 'label'\"")
    assert "Traceback (most recent call last)" in msg and "in broken_reward" in msg
    assert e.value.rank == 0 and e.value.error_type == "KeyError" and e.value.failed_ranks == [0]
    assert "in broken_reward" in e.value.traceback_text


def test_invalid_output_becomes_a_reward_error():
    def short(samples, prompts, outputs, **kw):
        return [0.0] * (len(samples) - 1)

    with pytest.raises(RewardError, match=r"reward function 'short': expected 7 rewards, got 6"):
        RewardStep([NamedRewardFn("short", short)], "main")(shard(0, 7))


def test_bad_step_arguments():
    with pytest.raises(ValueError, match="placement must be main, local or collective, got 'remote'"):
        RewardStep([NamedRewardFn("h", hashed)], "remote")
    with pytest.raises(ValueError, match="at least one reward function"):
        RewardStep([], "main")
    with pytest.raises(ValueError, match="batch_size must be > 0"):
        RewardStep([NamedRewardFn("h", hashed)], "main", batch_size=0)


def test_zero_samples_makes_no_call():
    calls = []
    rewards, stats = RewardStep([NamedRewardFn("f", lambda *a, **k: calls.append(1) or [])], "local", 4)(shard(0, 0))
    assert rewards == [] and calls == [] and stats.calls == 0 and stats.samples == 0


# ------------------------------------------------------------------------------------------------
# Collectives per step (counted at world size 1, where each one is still called: a no-op there)


@pytest.mark.parametrize("placement, expected", [
    ("main", ["gather_objects", "scatter_objects"]),
    ("local", ["all_gather_objects"]),  # the failures, exchanged by dist.agree
    ("collective", ["all_gather_objects", "all_gather_objects"]),  # the samples, then the failures
])
@pytest.mark.parametrize("fails", [False, True])
def test_each_placement_makes_the_same_collectives_whether_it_fails_or_not(monkeypatch, placement, expected, fails):
    """A failure travels in the step's own collectives: never one more, never one fewer (a rank that
    skipped one would leave the others waiting in it)."""
    from rallyrl import dist
    from rallyrl.dist import collectives

    made: list[str] = []
    for name in ("gather_objects", "scatter_objects", "all_gather_objects", "broadcast_object", "all_reduce_sum"):
        def counted(*args, _name=name, _fn=getattr(collectives, name), **kwargs):
            made.append(_name)
            return _fn(*args, **kwargs)

        monkeypatch.setattr(collectives, name, counted)  # what dist.agree calls
        monkeypatch.setattr(dist, name, counted)  # what the step calls

    def reward(samples, prompts, outputs, **kw):
        if fails:
            raise ValueError("down")
        return [1.0] * len(samples)

    step = RewardStep([NamedRewardFn("f", reward)], placement, 2)
    if fails:
        with pytest.raises(RewardError, match="reward step failed on rank 0: ValueError: down"):
            step(shard(0, 3))
    else:
        rewards, stats = step(shard(0, 3))
        assert [r.score for r in rewards] == [1.0] * 3 and stats.calls == 2 and stats.samples == 3
        assert stats.time_wait == stats.time_reward and stats.time_gather >= 0.0
    assert made == expected
