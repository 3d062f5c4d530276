"""One seeding scheme for every stream; one failure mechanism for every stage (world size 1 here; the
multi-process behaviour is in tests/dist)."""

import pytest

from rallyrl import dist, ops
from rallyrl.errors import CheckpointError, Failure, MetricError, RewardError, StageError
from rallyrl.seeding import stream_seed


def test_stream_seeds_are_deterministic_and_distinct():
    assert stream_seed(0, "sampling", 0) == stream_seed(0, "sampling", 0)
    seeds = {stream_seed(s, name, r) for s in (0, 1) for name in ("sampling", "minibatch") for r in (None, 0, 1)}
    assert len(seeds) == 12  # no two (seed, stream, rank) share a seed: seed 1/rank 0 != seed 0/rank 1
    assert all(0 <= x < 2**63 for x in seeds)


def test_streams_re_derived_at_an_iteration_are_new_and_deterministic():
    """A resume on another world size re-derives each rank's streams from (seed, rank, iteration)."""
    start = {stream_seed(s, name, r) for s in (0, 1) for name in ("sampling", "minibatch") for r in (0, 1, 2)}
    later = {stream_seed(s, name, r, iteration=i) for s in (0, 1) for name in ("sampling", "minibatch")
             for r in (0, 1, 2) for i in (0, 1, 5)}
    assert len(later) == 36 and not later & start  # iteration 0 is not the start-of-run stream either
    assert stream_seed(3, "sampling", 1, iteration=5) == stream_seed(3, "sampling", 1, iteration=5)
    assert stream_seed(3, "sampling", 1) == stream_seed(3, "sampling", 1, iteration=None)  # unchanged
    with pytest.raises(ValueError, match="per-rank"):
        stream_seed(3, "prompt_order", None, iteration=5)  # a shared stream is never re-derived


def test_agree_raises_the_stage_error_with_the_cause():
    def boom():
        raise ValueError("disk on fire")

    with pytest.raises(MetricError, match=r"metric_fn failed on rank 0: ValueError: disk on fire") as e:
        dist.agree(boom, MetricError, main_only=True)
    assert e.value.rank == 0 and e.value.error_type == "ValueError" and e.value.failed_ranks == [0]
    with pytest.raises(RewardError, match=r"^scoring failed on rank 0: ValueError"):
        dist.agree(boom, RewardError, what="scoring")
    assert dist.agree(lambda: 42, RewardError) == 42
    assert dist.agree(lambda: 43, RewardError, main_only=True) == 43


def test_agree_tells_the_time_of_its_exchange_only_and_before_it_raises(monkeypatch):
    """``on_exchange`` gets the seconds between the end of ``fn`` and the end of the exchange (the
    reward step's ``time/reward_gather``), not ``fn``'s own time, once per call, also when it raises."""
    from types import SimpleNamespace

    from rallyrl.dist import collectives

    ticks = iter([10.0, 10.5, 20.0, 21.25, 30.0, 30.125])
    monkeypatch.setattr(collectives, "time", SimpleNamespace(perf_counter=lambda: next(ticks)))
    told: list[float] = []

    def boom():
        raise ValueError("disk on fire")

    assert dist.agree(lambda: 7, RewardError, on_exchange=told.append) == 7
    assert told == [0.5]
    with pytest.raises(RewardError, match="disk on fire"):
        dist.agree(boom, RewardError, on_exchange=told.append)
    assert told == [0.5, 1.25]
    assert dist.agree(lambda: 8, RewardError, main_only=True, on_exchange=told.append) == 8
    assert told == [0.5, 1.25, 0.125]
    assert dist.agree(lambda: 9, RewardError) == 9  # no hook: nothing is timed
    assert next(ticks, None) is None


def test_a_stage_error_inside_is_not_wrapped_twice():
    def missing():
        raise CheckpointError("checkpoint runs/x/step_3 is incomplete: manifest.json is missing")

    with pytest.raises(CheckpointError, match=r"^checkpoint runs/x/step_3 is incomplete: manifest.json is missing$"):
        dist.agree(missing, CheckpointError, main_only=True)


def test_from_failures_takes_the_lowest_rank_and_lists_the_others():
    fs = [None, Failure(2, "KeyError", "b", ""), Failure(1, "ValueError", "a", "")]
    e = StageError.from_failures(fs, "reward step")
    assert str(e).startswith("reward step failed on rank 1: ValueError: a")
    assert "also failed on rank(s) 2" in str(e) and e.failed_ranks == [1, 2]


def test_lr_multiplier_hand_values():
    # warm-up 2 of 10 steps, then linear to 0 over the remaining 8
    assert [ops.lr_multiplier(s, 10, 2, "linear") for s in (0, 1, 2, 6, 10)] == [0.5, 1.0, 1.0, 0.5, 0.0]
    assert ops.lr_multiplier(5, 10, 0, "cosine") == pytest.approx(0.5)  # half way: (1 + cos(pi/2)) / 2
    assert ops.lr_multiplier(0, 10, 0, "cosine") == 1.0
    assert ops.lr_multiplier(7, 10, 0, "constant") == 1.0
    with pytest.raises(ValueError, match="unknown lr schedule"):
        ops.lr_multiplier(1, 10, 0, "step")


def test_collective_timeouts_are_translated_but_stage_errors_are_not():
    gloo = RuntimeError("[../gloo/transport/tcp/pair.cc:534] Timed out waiting 5000ms for recv operation")
    assert "waited" in str(dist.timeout_error(gloo))
    # a typed report that merely names reward.timeout_s keeps its own type and message
    assert dist.timeout_error(RewardError("reward step failed: exceeded reward.timeout_s=2")) is None
    assert dist.timeout_error(ValueError("timeout")) is None
