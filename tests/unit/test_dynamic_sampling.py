"""DAPO's dynamic sampling and the other batch-side pieces of issue 29, in one process (ms):

- ``Selection`` by hand: which (round, group) pairs make the batch, surplus, discards, fillers;
- ``sample_groups`` over rounds built by hand: new group ids and global indices, filler flags, metrics;
- the advantages: filler groups out of the group statistics and the loss; ``ppo.mask_truncated``;
- ``Rollouts.select`` / ``add_reward`` / flags through ``concat``; ``cut_by_length``.
(The multi-process guarantees are in tests/dist/test_dynamic_sampling_runs.py.)
"""

from __future__ import annotations

import pytest
import torch

from rallyrl import dist
from rallyrl.config import BatchPlan, load_config
from rallyrl.learn.advantages import compute_advantages
from rallyrl.learn.state import TrainState
from rallyrl.reward.step import StepStats
from rallyrl.rollout import Rollouts, SamplingSpec, Shard
from rallyrl.rollout.dynamic import Selection, sample_groups
from rallyrl.rollout.episode import cut_by_length

G = 2


def test_selection_fills_the_batch_in_round_then_group_order():
    sel = Selection(need=3)
    sel.add([True, False, True])  # round 0: groups 0 and 2 vary
    assert (sel.kept, sel.reserve, sel.discarded, sel.full) == ([(0, 0), (0, 2)], [(0, 1)], 1, False)
    sel.add([False, True, True])  # round 1: group 1 completes the batch, group 2 is surplus
    assert sel.kept == [(0, 0), (0, 2), (1, 1)] and sel.full
    assert (sel.unused, sel.discarded, sel.reserve, sel.rounds) == (1, 2, [], 2)
    assert sel.batch() == [(0, 0), (0, 2), (1, 1)]


def test_a_short_batch_is_filled_with_the_earliest_zero_spread_groups():
    sel = Selection(need=3)
    sel.add([False, False, True])
    sel.add([False, True, False])
    assert sel.kept == [(0, 2), (1, 1)] and not sel.full
    assert sel.reserve == [(0, 0)] and sel.discarded == 4  # only as many as the batch lacks are held
    assert sel.batch() == [(0, 2), (1, 1), (0, 0)]


def _round(r: int, scores: list[float]) -> Rollouts:
    """Round ``r``'s batch: 3 prompts x G = 2, every tensor row tagged with (round, index) to follow it."""
    n = len(scores)
    tag = torch.tensor([[10 * r + i] for i in range(n)])  # (n, 1)
    ones = torch.ones(n, 2, dtype=torch.bool)
    return Rollouts(tag, torch.ones(n, 1, dtype=torch.bool), tag.expand(n, 2).clone(), ones, ones,
                    -torch.ones(n, 2), None, None, torch.tensor(scores), None,
                    [f"p{r}.{i // G}" for i in range(n)], [f"o{r}.{i}" for i in range(n)], [{}] * n, list(range(n)),
                    [i // G for i in range(n)], [{} for _ in range(n)])


PLAN = BatchPlan(world_size=1, num_rollouts=6, chunk_size=6, local_counts=(6,), rounds=1, num_minibatches=1,
                 epochs=1, samples_per_prompt=G)


def _run(rounds: list[list[float]], max_rounds: int):
    calls = []

    def draw() -> Shard:
        calls.append(len(calls))
        return Shard([], 0, 1, 6, G)

    def collect(shard: Shard):
        r = len(calls) - 1
        return _round(r, rounds[r]), StepStats(calls=1, samples=6), {"time/generate": 1.0}

    ro, stats, metrics = sample_groups(draw, collect, PLAN, max_rounds, None, 0)
    return ro, stats, metrics, len(calls)


def test_sample_groups_relabels_the_kept_groups_in_order():
    # round 0: group 0 (1, 1) equal, group 1 (0, 1) varies, group 2 (2, 2) equal
    # round 1: group 0 (5, 6) varies, group 1 (3, 3) equal, group 2 (0, 9) varies -> the batch is full
    ro, stats, m, draws = _run([[1, 1, 0, 1, 2, 2], [5, 6, 3, 3, 0, 9], [7, 8, 7, 8, 7, 8]], max_rounds=5)
    assert draws == 2 and stats.calls == 2 and m["time/generate"] == 2.0
    assert ro.query_ids[:, 0].tolist() == [2, 3, 10, 11, 14, 15]  # (round 0, samples 2-3), (round 1, 0-1), (1, 4-5)
    assert ro.prompts == ["p0.1", "p0.1", "p1.0", "p1.0", "p1.2", "p1.2"]
    assert ro.global_index == list(range(6)) and ro.group == [0, 0, 1, 1, 2, 2]
    assert ro.scores.tolist() == [0, 1, 5, 6, 0, 9] and ro.flags("filler").tolist() == [False] * 6
    assert m["rollout/sampling_rounds"] == 2 and m["rollout/groups_discarded"] == 3
    assert m["rollout/groups_unused"] == 0 and m["rollout/short_groups"] == 0


def test_sample_groups_stops_at_max_rounds_and_fills_with_flagged_groups():
    ro, _, m, draws = _run([[1, 1, 0, 1, 2, 2], [3, 3, 4, 4, 5, 5]], max_rounds=2)
    assert draws == 2
    # kept: round 0 group 1; fillers: the earliest zero-spread groups, round 0 groups 0 and 2
    assert ro.prompts == ["p0.1", "p0.1", "p0.0", "p0.0", "p0.2", "p0.2"]
    assert ro.flags("filler").tolist() == [False, False, True, True, True, True]
    assert ro.group == [0, 0, 1, 1, 2, 2] and ro.global_index == list(range(6))
    assert (m["rollout/short_groups"], m["rollout/groups_discarded"]) == (2, 5)


def _state(**ppo):
    cfg = load_config({"ppo": {"estimator": "grpo", "init_kl_coef": 0.0, **ppo},
                       "rollout": {"num_rollouts": 6, "samples_per_prompt": G}})
    return TrainState.fresh(cfg, num_prompts=3, shuffle_seed=0), cfg.ppo


def test_filler_groups_stay_out_of_the_statistics_and_the_loss():
    ro, _, _, _ = _run([[1, 1, 0, 1, 2, 2], [3, 3, 4, 4, 5, 5]], max_rounds=2)
    state, ppo = _state(group_scale="batch")
    adv = compute_advantages(ro, state, ppo)
    # only group 0 (scores 0, 1) is trained: batch std over its 2 scores = sqrt(0.5); (0 - 0.5) / sqrt(0.5)
    s = 0.5**0.5
    assert adv.seq_advantages == pytest.approx([-0.5 / s, 0.5 / s, 0, 0, 0, 0])
    assert adv.loss_mask.any(1).tolist() == [True, True, False, False, False, False]
    assert adv.stats["reward/group_std"] == pytest.approx(s) and adv.stats["reward/zero_std_groups"] == 0
    assert adv.stats["policy/advantage_abs"] == pytest.approx(0.5 / s)


def test_filler_groups_and_unscorable_samples_both_stay_out_of_the_statistics():
    """Dynamic sampling with a reward that returns None for some samples: a group's baseline is over its
    scorable members of the trained groups only."""
    ro = _round(0, [0.0, 1.0, 9.0, 2.0, 7.0, 7.0])  # groups of 2: (0, 1), (9, 2), (7, 7)
    ro.filler = [False, False, False, False, True, True]
    ro.scorable = torch.tensor([True, True, False, True, True, True])
    state, ppo = _state(group_scale="batch")
    adv = compute_advantages(ro, state, ppo)
    # kept and scorable: 0, 1 (group 0) and 2 (group 1, alone: no baseline, advantage 0); the 9 is not
    # scored and the filler group is out. Batch std over 0, 1, 2 = 1: group 0 -> -0.5, 0.5.
    assert adv.seq_advantages == pytest.approx([-0.5, 0.5, 0, 0, 0, 0])
    assert adv.loss_mask.any(1).tolist() == [True, True, True, True, False, False]
    assert adv.stats["reward/zero_std_groups"] == pytest.approx(1 / 2)


def test_mask_truncated_leaves_the_loss_not_the_group_statistics():
    ro = _round(0, [0.0, 1.0, 2.0, 4.0, 3.0, 3.0])
    ro.truncated = [True, False, False, False, False, False]
    state, ppo = _state(mask_truncated=True, estimator="rloo")
    adv = compute_advantages(ro, state, ppo)
    # rloo over all members, the truncated one included: 0 - 1 = -1, 1 - 0 = 1; 2 - 4, 4 - 2; 0, 0
    assert adv.seq_advantages == [-1.0, 1.0, -2.0, 2.0, 0.0, 0.0]
    assert adv.loss_mask.any(1).tolist() == [False, True, True, True, True, True]
    assert adv.stats["rollout/truncated"] == pytest.approx(1 / 6)
    off = compute_advantages(ro, state, _state(estimator="rloo")[1])
    assert off.loss_mask.all() and "rollout/truncated" not in off.stats
    gae = load_config({"ppo": {"mask_truncated": True}})  # gae too: out of the policy and value losses
    ro.values = torch.zeros(6, 2)
    gae_adv = compute_advantages(ro, TrainState.fresh(gae, 3, 0), gae.ppo)
    assert gae_adv.loss_mask.any(1).tolist() == [False] + [True] * 5


def test_rollouts_select_add_reward_and_flags_through_concat():
    a, b = _round(0, [1.0, 2.0]), _round(1, [3.0, 4.0])
    a.truncated = [False, True]
    a.add_reward("overlong", torch.tensor([-0.25, 0.0], dtype=torch.float64))
    assert a.scores.tolist() == [0.75, 2.0] and a.reward_components == [{"overlong": -0.25}, {"overlong": 0.0}]
    with pytest.raises(ValueError, match="'overlong' is already set"):
        a.add_reward("overlong", torch.zeros(2))
    both = Rollouts.concat([a, b], 0)
    assert both.truncated == [False, True, False, False] and both.filler == []  # unset in every part stays unset
    back = both.select([3, 1])
    assert back.outputs == ["o1.1", "o0.1"] and back.truncated == [False, True] and back.scores.tolist() == [4.0, 2.0]
    assert back.query_ids[:, 0].tolist() == [11, 1]


def test_exchange_objects_on_one_process():
    assert dist.exchange_objects([["x"]]) == [["x"]]
    with pytest.raises(ValueError, match="2 objects for 1 ranks"):
        dist.exchange_objects([1, 2])


class _Chars:
    """A tokenizer whose token i is the character chr(i)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


@pytest.mark.parametrize("ids, truncated", [
    ([97, 98], False),  # shorter than max_new_tokens: it stopped
    ([97, 98, 99], True),  # the budget ran out
    ([97, 98, 0], False),  # the last token is the stop token
    ([97, 98, 46], False),  # the stop sequence "." completed by the last token
    ([120, 121, 98], False),  # the stop sequence "yb" spans the last two tokens
])
def test_cut_by_length(ids, truncated):
    spec = SamplingSpec(max_new_tokens=3, stop_token_ids=(0,), stop_sequences=(".", "yb"))
    assert cut_by_length(ids, spec, _Chars()) is truncated
    assert cut_by_length(ids, SamplingSpec(max_new_tokens=3, stop_token_ids=(0,)), _Chars()) is (
        len(ids) == 3 and ids[-1] != 0)
