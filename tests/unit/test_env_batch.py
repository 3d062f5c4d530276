"""Multi-turn episodes in the training batch: one reward per episode placed on its rows (forks included),
per-turn environment rewards through GAE by hand, advantages per episode (not per row) for the critic-free
estimators, a forked episode's GAE bootstrapped across its rows, and episode/* metrics."""

from __future__ import annotations

import pytest
import torch

from rallyrl.config import BatchPlan, load_config
from rallyrl.learn.advantages import compute_advantages
from rallyrl.learn.metrics import iteration_metrics
from rallyrl.learn.state import TrainState
from rallyrl.learn.update import UPDATE_STATS
from rallyrl.reward.step import Reward, StepStats
from rallyrl.rollout import Advantages, Rollouts
from rallyrl.rollout.episode import Episodes
from rallyrl.rollout.scoring import Scored


def _state(**ppo):
    cfg = load_config({"train": {"run_dir": "unused"}, "ppo": {"init_kl_coef": 0.0, **ppo},
                       "rollout": {"num_rollouts": 4, "samples_per_prompt": 2 if ppo.get("estimator") else 1}})
    return TrainState.fresh(cfg, num_prompts=2, shuffle_seed=0), cfg.ppo


def _transcript(turns, forks=0, truncated=False, rewards=None, calls=0, errors=0):
    tool = [{"name": "t", "arguments": {}, "result": "x", "error": "e" if i < errors else None} for i in range(calls)]
    return {"messages": [], "turns": [{"text": "a", "token_ids": [1], "tokens": 1, "tool_calls": tool if i == 0 else [],
                                       "env_messages": [], "reward": None, "env_tokens": 0} for i in range(turns)],
            "truncated": truncated, "forks": forks, "env_rewards": rewards or [None] * turns}


def _forked_episodes():
    """Episode 0 forked into rows 0 and 1 (row 0: 2 actions; row 1: 1 action, 1 env token, 1 action);
    episode 1 one row (3 actions)."""
    am = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 1, 0]], dtype=torch.bool)
    rm = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 0]], dtype=torch.bool)
    ids = torch.arange(12).reshape(3, 4)
    ep = Episodes(torch.ones(3, 1, dtype=torch.long), torch.ones(3, 1, dtype=torch.bool), ids, rm, am,
                  [[0, 1, 4, 5, 6], [8, 9, 10]], ["out0", "out1"])
    ep.row_episode = [0, 0, 1]
    ep.transcripts = [_transcript(2, forks=1, calls=2, errors=1), _transcript(1, truncated=True)]
    ep.env_scores = [0.25, 0.0]
    return ep


def test_an_episodes_reward_goes_on_its_last_row_and_its_dense_part_is_cut_into_its_rows():
    ep = _forked_episodes()
    z = torch.zeros(3, 4)
    rewards = [Reward(1.0, dense=[0.1, 0.2, 0.3, 0.4, 0.5], components={"r": 2.5}), Reward(-1.0, components={"r": -1.0})]
    ro = Rollouts.from_chunk(ep, Scored(z, None, None), rewards, ["p0", "p1"], [{"m": 0}, {"m": 1}], [6, 7], group_size=2)
    assert ro.scores.tolist() == [0.0, 1.25, -1.0]  # score + the environment's summed rewards, on the last row
    torch.testing.assert_close(ro.dense_scores, torch.tensor([[0.1, 0.2, 0, 0], [0.3, 0.4, 0.5, 0], [0, 0, 0, 0]]))
    assert ro.global_index == [6, 6, 7] and ro.group == [3, 3, 3] and ro.segment == [0, 1, 0]
    assert ro.prompts == ["p0", "p0", "p1"] and ro.metadata == [{"m": 0}, {"m": 0}, {"m": 1}]
    assert ro.episodes == [None, ep.transcripts[0], ep.transcripts[1]] and ro.reward_components == [{}, {"r": 2.5}, {"r": -1.0}]
    assert ro.last_rows().tolist() == [False, True, True]
    both = Rollouts.concat([ro, ro], pad_id=0)
    assert both.segment == [0, 1, 0] * 2 and both.episodes[1] is ep.transcripts[0]


def test_a_separate_engines_log_probs_are_kept_per_row_beside_the_trainers():
    """generation.engine: vllm samples the turns: the engine's log-probs (0 on environment tokens) travel
    with each row as engine_logprobs, beside the trainer's own (rollout.logprobs_from: forward); with
    logprobs_from: generate the engine's ARE the old log-probs and nothing is kept apart."""
    ep = _forked_episodes()
    ep.logprobs = torch.tensor([[-1.0, -2.0, 0, 0], [-0.5, 0, -0.25, 0], [-3.0, -1.5, -0.75, 0]])  # (B, T)
    trainer = ep.logprobs + 0.01 * ep.action_mask
    ro = Rollouts.from_chunk(ep, Scored(trainer, None, None), [Reward(1.0), Reward(2.0)], ["p", "q"], [{}, {}], [0, 1])
    assert ro.engine_logprobs is ep.logprobs and ro.logprobs is trainer
    assert ro.engine_logprobs[1, 1] == 0 and not ro.action_mask[1, 1]  # the environment's token: no action
    kept = ro.select(torch.tensor([1, 2]))
    torch.testing.assert_close(kept.engine_logprobs, ep.logprobs[1:])
    same = Rollouts.from_chunk(ep, Scored(ep.logprobs, None, None), [Reward(1.0), Reward(2.0)], ["p", "q"], [{}, {}],
                               [0, 1])
    assert same.engine_logprobs is None


def _rows(am, values, scores, dense=None, index=None, segment=None, group=None):
    n = len(am)
    am = torch.tensor(am, dtype=torch.bool)
    return Rollouts(torch.ones(n, 1, dtype=torch.long), torch.ones(n, 1, dtype=torch.bool), torch.ones(am.shape, dtype=torch.long),
                    torch.ones_like(am), am, torch.zeros(am.shape), None,
                    torch.tensor(values) if values is not None else None, torch.tensor(scores),
                    torch.tensor(dense) if dense is not None else None, ["p"] * n, ["o"] * n, [{}] * n,
                    index or list(range(n)), group or [0] * n, [{}] * n, segment or [], [None] * n if segment else [])


def test_per_turn_rewards_cross_an_environment_span_in_gae_by_hand():
    """Row: turn 1 = actions 0-1, environment tokens 2-3, turn 2 = actions 4-5. Turn 1's reward (0.5,
    env.turn_rewards: per_turn) on column 1, the score (1.0) on column 5. gamma 0.9, lam 0.5: the chain
    runs 0 -> 1 -> 4 -> 5 (the span costs no discount step; its values are never read)."""
    state, ppo = _state(gamma=0.9, lam=0.5, whiten_advantages=False)
    v = [0.4, 0.3, 9.0, 9.0, 0.2, 0.1]
    ro = _rows([[1, 1, 0, 0, 1, 1]], [v], [1.0], dense=[[0.0, 0.5, 7.0, 7.0, 0.0, 0.0]])
    adv = compute_advantages(ro, state, ppo)
    # deltas: d5 = 1.0 - 0.1 = 0.9; d4 = 0 + 0.9 * 0.1 - 0.2 = -0.11; d1 = 0.5 + 0.9 * 0.2 - 0.3 = 0.38;
    # d0 = 0 + 0.9 * 0.3 - 0.4 = -0.13. A5 = 0.9; A4 = -0.11 + 0.45 * 0.9 = 0.295; A1 = 0.38 + 0.45 * 0.295
    # = 0.51275; A0 = -0.13 + 0.45 * 0.51275 = 0.1007375.
    expected = [0.1007375, 0.51275, 0.0, 0.0, 0.295, 0.9]
    torch.testing.assert_close(adv.advantages[0], torch.tensor(expected), atol=1e-6, rtol=0)


def test_a_forked_episodes_gae_bootstraps_from_the_row_that_continues_it():
    state, ppo = _state(gamma=0.9, lam=0.5, whiten_advantages=False)
    # rows 0 and 1: one episode (index 3) forked; row 0's end bootstraps with 0.9 * V(row 1's first action)
    ro = _rows([[1, 1], [1, 1]], [[0.5, 0.2], [0.4, 0.1]], [0.0, 1.0], index=[3, 3], segment=[0, 1])
    adv = compute_advantages(ro, state, ppo)
    # row 0: r = [0, 0.36]; d1 = 0.36 - 0.2 = 0.16; d0 = 0.9 * 0.2 - 0.5 = -0.32; A0 = -0.32 + 0.45 * 0.16
    # row 1: r = [0, 1.0]; d1 = 0.9; d0 = 0.09 - 0.4 = -0.31; A0 = -0.31 + 0.45 * 0.9 = 0.095
    torch.testing.assert_close(adv.advantages, torch.tensor([[-0.248, 0.16], [0.095, 0.9]]), atol=1e-6, rtol=0)


def test_critic_free_groups_count_episodes_not_rows():
    state, ppo = _state(estimator="grpo")
    # group 0 = episodes 0 (rows 0, 1: forked; score 1.0 on row 1, dense 0.5 on row 0) and 1 (row 2, score 0)
    ro = _rows([[1, 1], [1, 0], [1, 1]], None, [0.0, 1.0, 0.0], dense=[[0.0, 0.5], [0.0, 0.0], [0.0, 0.0]],
               index=[0, 0, 1], segment=[0, 1, 0], group=[0, 0, 0])
    adv = compute_advantages(ro, state, ppo)
    # episodes score 1.5 and 0.0: mean 0.75, unbiased std 1.0607 -> +-0.7071 (a row-level count would
    # have seen three samples)
    a = 0.75 / (1.5**2 / 2) ** 0.5
    assert adv.seq_advantages == pytest.approx([a, a, -a])
    assert (adv.advantages[1] == torch.tensor([a, 0.0], dtype=adv.advantages.dtype)).all()


def test_episode_metrics():
    state, _ = _state()
    ep = _forked_episodes()
    ro = Rollouts.from_chunk(ep, Scored(torch.zeros(3, 4), None, torch.zeros(3, 4)), [Reward(1.0), Reward(2.0)],
                             ["p", "q"], [{}, {}], [0, 1])
    adv = Advantages(torch.zeros(3, 4), torch.zeros(3, 4), None, ro.action_mask)
    plan = BatchPlan(world_size=1, num_rollouts=2, chunk_size=2, local_counts=(2,), rounds=1, num_minibatches=1, epochs=1)
    upd = {k: 1.0 for k in UPDATE_STATS} | {"grad_norm": 0.5, "steps": 1.0, "skipped": 0.0, "time": 1.0}
    m = iteration_metrics(ro, adv, StepStats(), upd, ["r"], state, plan)
    assert m["episode/turns"] == 1.5 and m["episode/tool_calls"] == 1.0 and m["episode/tool_errors"] == 0.5
    assert m["episode/truncated"] == 0.5 and m["episode/forks"] == 0.5
    assert m["episode/env_token_fraction"] == 1 / 8  # 1 environment token of 8 response tokens
    assert m["reward/mean"] == pytest.approx((1.25 + 2.0) / 2)  # per episode, not per row
    assert m["policy/response_length"] == 8 / 2


def test_an_episode_without_a_reward_is_unscorable_on_each_of_its_rows():
    """None from every reward function (TRL #5902) for a forked episode: all its rows carry it, its group
    baseline leaves it out, and reward/mean and reward/unscorable count it once (per episode)."""
    ep = _forked_episodes()
    z = torch.zeros(3, 4)
    rewards = [Reward(0.0, scorable=False), Reward(2.0)]
    ro = Rollouts.from_chunk(ep, Scored(z, None, z), rewards, ["p0", "p1"], [{}, {}], [0, 1], group_size=2)
    assert ro.scorable.tolist() == [False, False, True]
    state, ppo = _state(estimator="grpo")
    adv = compute_advantages(ro, state, ppo)
    assert adv.seq_advantages == [0.0, 0.0, 0.0]  # the group's only scorable member has no baseline
    assert adv.stats["reward/zero_std_groups"] == 1.0
    plan = BatchPlan(world_size=1, num_rollouts=2, chunk_size=2, local_counts=(2,), rounds=1, num_minibatches=1, epochs=1)
    upd = {k: 1.0 for k in UPDATE_STATS} | {"grad_norm": 0.5, "steps": 1.0, "skipped": 0.0, "time": 1.0}
    m = iteration_metrics(ro, Advantages(z, z, None, ro.action_mask), StepStats(), upd, ["r"], state, plan)
    assert m["reward/unscorable"] == 1.0 and m["reward/mean"] == 2.0


@pytest.mark.parametrize("option", [{"rollout": {"dynamic_sampling": True}},
                                    {"reward": {"overlong_buffer": {"length": 4, "penalty": 1.0}}, "generation": {"max_new_tokens": 8}},
                                    {"ppo": {"mask_truncated": True}}])
def test_single_turn_options_are_refused_with_an_environment(option):
    from rallyrl.config import ConfigError

    base = {"train": {"run_dir": "unused"}, "env": {"factory": "tests.helpers.envs:Echo"},
            "ppo": {"estimator": "grpo"}, "rollout": {"num_rollouts": 4, "samples_per_prompt": 2}}
    for k, v in option.items():
        base.setdefault(k, {}).update(v)
    section = next(k for k in option if k != "generation")
    key = section + "." + next(iter(option[section]))
    with pytest.raises(ConfigError, match=rf"{key}.*single-turn samples only"):
        load_config(base)
