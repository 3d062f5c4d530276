"""The critic-free estimators and the loss-aggregation contract, against values worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from rallyrl import ops
from rallyrl.config import ConfigError, load_config

# Two groups interleaved (ids, not positions): group 0 scores 1, 2, 3; group 1 scores 0, 0.
SCORES = torch.tensor([1.0, 0.0, 2.0, 0.0, 3.0])
GROUPS = torch.tensor([0, 1, 0, 1, 0])


def test_grpo_group_scale_hand_values():
    # group 0: mean 2, unbiased std sqrt((1 + 0 + 1) / 2) = 1 -> -1, 0, 1; group 1: all equal -> 0
    adv, zero, std = ops.group_advantages(SCORES, GROUPS, "grpo", "group")
    assert adv.tolist() == [-1.0, 0.0, 0.0, 0.0, 1.0]
    assert zero.tolist() == [False, True, False, True, False]
    assert std.tolist() == [1.0, 0.0]


def test_grpo_batch_scale_divides_by_the_whole_batch_std():
    # batch: mean 1.2, unbiased variance (0.04 + 1.44 + 0.64 + 1.44 + 3.24) / 4 = 1.7
    adv, _, _ = ops.group_advantages(SCORES, GROUPS, "grpo", "batch")
    s = math.sqrt(1.7)
    assert adv.tolist() == pytest.approx([-1 / s, 0.0, 0.0, 0.0, 1 / s], abs=1e-12)


def test_grpo_scale_none_is_dr_grpo_centring_only():
    adv, _, _ = ops.group_advantages(SCORES * 10, GROUPS, "grpo", "none")
    assert adv.tolist() == [-10.0, 0.0, 0.0, 0.0, 10.0]


def test_rloo_leave_one_out_hand_values():
    # 1 - (2 + 3) / 2 = -1.5;  2 - (1 + 3) / 2 = 0;  3 - (1 + 2) / 2 = 1.5
    adv, _, _ = ops.group_advantages(SCORES, GROUPS, "rloo")
    assert adv.tolist() == [-1.5, 0.0, 0.0, 0.0, 1.5]


def test_std_floor_bounds_the_divisor():
    # std of (0.5, 0.5 + 2e-6) is sqrt(2) * 1e-6, far below the floor 1e-4: the centred +-1e-6 is divided by 1e-4
    adv, zero, _ = ops.group_advantages(torch.tensor([0.5, 0.5 + 2e-6], dtype=torch.float64), torch.tensor([0, 0]),
                                        "grpo", "group", std_floor=1e-4)
    assert adv.tolist() == pytest.approx([-1e-2, 1e-2], rel=1e-6)
    assert not zero.any()


def test_equal_rewards_give_exactly_zero_and_no_nan():
    # 0.1 * 3 / 3 != 0.1 in floating point: r - mean would leave a residue that a tiny std blows up
    for est in ("grpo", "rloo"):
        adv, zero, _ = ops.group_advantages(torch.tensor([0.1, 0.1, 0.1, 7.0, 7.0]), torch.tensor([2, 2, 2, 5, 5]),
                                            est, "group")
        assert adv.tolist() == [0.0] * 5 and zero.all()


def test_a_group_of_one_has_no_baseline_and_gets_zero():
    # (veRL's mean-0/std-1 rule would give it its raw score 5.0)
    adv, zero, std = ops.group_advantages(torch.tensor([5.0, 1.0, 3.0]), torch.tensor([0, 1, 1]), "grpo", "group")
    assert adv[0] == 0.0 and zero[0] and std[0] == 0.0
    assert adv[1:].tolist() == pytest.approx([-1 / math.sqrt(2), 1 / math.sqrt(2)])


def test_statistics_are_by_id_not_position():
    """Any order of the same samples (e.g. a group split over two ranks, gathered rank by rank) gives
    each sample the same advantage."""
    g = torch.Generator().manual_seed(0)
    scores, groups = torch.rand(24, generator=g), torch.arange(24) // 8
    for est, scale in (("grpo", "group"), ("grpo", "batch"), ("rloo", "group")):
        base, _, _ = ops.group_advantages(scores, groups, est, scale)
        perm = torch.randperm(24, generator=g)
        moved, _, _ = ops.group_advantages(scores[perm], groups[perm], est, scale)
        assert torch.equal(moved, base[perm])


def test_unknown_estimator_or_scale_is_named():
    with pytest.raises(ValueError, match="'ppo'"):
        ops.group_advantages(SCORES, GROUPS, "ppo")
    with pytest.raises(ValueError, match="'std'"):
        ops.group_advantages(SCORES, GROUPS, "grpo", "std")


# ---------------------------------------------------------------------------------------------------
# loss aggregation

PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])  # the 9s are padding: never read
MASK = torch.tensor([[True, True, True], [True, False, False]])


def test_aggregation_hand_values():
    n_tok, n_seq = ops.loss_units(MASK, "token_mean"), ops.loss_units(MASK, "seq_mean_token_mean")
    assert (int(n_tok), int(n_seq)) == (4, 2)
    assert float(ops.aggregate_loss(PER_TOKEN, MASK, "token_mean", n_tok)) == 2.5  # (1+2+3+4) / 4
    assert float(ops.aggregate_loss(PER_TOKEN, MASK, "seq_mean_token_mean", n_seq)) == 3.0  # (6/3 + 4/1) / 2
    assert float(ops.aggregate_loss(PER_TOKEN, MASK, "seq_mean_token_sum", n_seq, max_len=4)) == 1.25  # 10/4/2


@pytest.mark.parametrize("mode", ops.LOSS_AGGREGATIONS)
def test_any_split_sums_to_the_whole_with_the_global_normaliser(mode):
    """Split rows over 'ranks' / micro-batches: each part normalised by the global count sums to the
    loss of the whole batch (and so does its gradient)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 5, generator=g, dtype=torch.float64, requires_grad=True)
    mask = torch.arange(5) < torch.tensor([5, 1, 3, 2, 4, 5, 1]).unsqueeze(1)
    norm = ops.loss_units(mask, mode)
    whole = ops.aggregate_loss(x, mask, mode, norm, max_len=5)
    (g_whole,) = torch.autograd.grad(whole, x)
    parts = [slice(0, 2), slice(2, 3), slice(3, 7)]
    split = sum(ops.aggregate_loss(x[p], mask[p], mode, norm, max_len=5) for p in parts)
    (g_split,) = torch.autograd.grad(split, x)
    assert float(split.detach()) == pytest.approx(float(whole.detach()), rel=1e-12)
    assert torch.allclose(g_split, g_whole, rtol=1e-12, atol=0)


def test_clip_range_high_clips_only_the_upper_side():
    # ratio 1.5 with advantage +1: unclipped -1.5, clipped at 1 + high; ratio 0.5 with advantage -1: 1 - 0.2
    lp = torch.log(torch.tensor([[1.5, 0.5]]))
    old, adv, m = torch.zeros(1, 2), torch.tensor([[1.0, -1.0]]), torch.ones(1, 2, dtype=torch.bool)
    loss_sym, _ = ops.policy_loss(lp, old, adv, m, 0.2, num_tokens=1.0)
    loss_high, _ = ops.policy_loss(lp, old, adv, m, 0.2, num_tokens=1.0, clip_range_high=0.28)
    # symmetric: max(-1.5, -1.2) + max(0.5, 0.8) = -1.2 + 0.8; clip-higher: -1.28 + 0.8
    assert float(loss_sym) == pytest.approx(-1.2 + 0.8)
    assert float(loss_high) == pytest.approx(-1.28 + 0.8)


# ---------------------------------------------------------------------------------------------------
# config


def _cfg(**sections):
    return load_config({"train": {"run_dir": "unused"}, **sections})


def test_group_config_errors_name_the_keys():
    with pytest.raises(ConfigError, match=r"rollout.num_rollouts=10 must be a multiple of rollout.samples_per_prompt=4"):
        _cfg(rollout={"num_rollouts": 10, "samples_per_prompt": 4})
    for est in ("grpo", "rloo"):
        with pytest.raises(ConfigError, match=f"ppo.estimator={est} needs rollout.samples_per_prompt >= 2"):
            _cfg(ppo={"estimator": est})
    with pytest.raises(ConfigError, match="drop_zero_std_groups is for ppo.estimator grpo or rloo"):
        _cfg(ppo={"drop_zero_std_groups": True})
    with pytest.raises(ConfigError, match="expected one of"):
        _cfg(ppo={"estimator": "grpo2"})


def test_groups_need_no_per_rank_divisibility():
    """7 processes, G = 8: only num_rollouts % G matters (TRL needed the batch to divide over ranks)."""
    from rallyrl.config import make_batch_plan

    cfg = _cfg(rollout={"num_rollouts": 64, "samples_per_prompt": 8}, ppo={"estimator": "grpo"})
    plan = make_batch_plan(cfg, 7)
    assert plan.local_counts == (10, 9, 9, 9, 9, 9, 9) and plan.prompts_per_iteration == 8
    ids = plan.sample_prompts([4, 2])
    assert ids[:8] == [4] * 8 and ids[8:] == [2] * 8


def test_estimator_and_group_size_are_training_settings_on_resume():
    from rallyrl.config import config_changes

    a = _cfg(rollout={"num_rollouts": 8, "samples_per_prompt": 4}, ppo={"estimator": "grpo"}).to_dict()
    b = _cfg(rollout={"num_rollouts": 8, "samples_per_prompt": 2}, ppo={"estimator": "rloo"}).to_dict()
    keys = {c.key: c.needs_permission for c in config_changes(a, b)}
    assert keys == {"rollout.samples_per_prompt": True, "ppo.estimator": True}
