"""Two masks, never one: the stages after the rollout use ``action_mask`` (what was sampled) for the loss,
the KL, value targets, advantages and per-token statistics, and the attention mask only for what the model
sees. Rows here have holes (environment tokens inside the response), as multi-turn episodes will."""

from __future__ import annotations

import pytest
import torch

from rallyrl.config import BatchPlan, load_config
from rallyrl.learn.advantages import compute_advantages
from rallyrl.learn.metrics import iteration_metrics
from rallyrl.learn.state import TrainState
from rallyrl.learn.update import UPDATE_STATS
from rallyrl.reward.step import StepStats
from rallyrl.rollout import Advantages, Rollouts

# Row 0: 2 actions, 2 environment tokens, 1 action. Row 1: 1 action, 1 environment token, 1 action, padding.
ACTIONS = torch.tensor([[1, 1, 0, 0, 1], [1, 0, 1, 0, 0]], dtype=torch.bool)
ATTENTION = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)


def _rollouts(values: bool, n: int = 2) -> Rollouts:
    am, rm = ACTIONS[:n], ATTENTION[:n]
    # log-probs and reference log-probs that are NOT zero on the holes: nothing may read them there
    lp = torch.full(am.shape, -1.0)
    ref = torch.full(am.shape, -1.5)
    v = torch.where(am, 0.5, 9.0) if values else None  # 9 on holes and padding: never read there
    return Rollouts(torch.ones(n, 1, dtype=torch.long), torch.ones(n, 1, dtype=torch.bool),
                    torch.ones(am.shape, dtype=torch.long), rm, am, lp, ref, v,
                    torch.tensor([1.0, 0.0][:n]), None, ["p"] * n, ["o"] * n, [{}] * n, list(range(n)),
                    [0] * n, [{}] * n)


def _state(**ppo) -> TrainState:
    cfg = load_config({"train": {"run_dir": "unused"}, "ppo": {"init_kl_coef": 0.1, **ppo},
                       "rollout": {"num_rollouts": 2, "samples_per_prompt": 2 if ppo.get("estimator") else 1}})
    return TrainState.fresh(cfg, num_prompts=2, shuffle_seed=0), cfg.ppo


def test_gae_advantages_kl_and_returns_are_on_actions_only():
    state, ppo = _state(whiten_advantages=False, gamma=1.0, lam=1.0)
    ro = _rollouts(values=True, n=1)
    adv = compute_advantages(ro, state, ppo)
    # per action token: KL k1 = -1 - (-1.5) = 0.5, penalty -0.1 * 0.5 = -0.05; the score 1.0 on the last
    # action token (column 4, after the environment span). gamma = lam = 1: A_k = sum of rewards from k on
    # over ACTION tokens minus V_k (0.5); holes carry nothing and get 0.
    r = [-0.05, -0.05, 0.0, 0.0, 0.95]
    a = [r[0] + r[1] + r[4] - 0.5, r[1] + r[4] - 0.5, 0.0, 0.0, r[4] - 0.5]
    torch.testing.assert_close(adv.advantages[0], torch.tensor(a), atol=1e-6, rtol=0)
    torch.testing.assert_close(adv.returns[0], torch.tensor([x + 0.5 if m else 0.0 for x, m in zip(a, ACTIONS[0])]),
                               atol=1e-6, rtol=0)
    assert torch.equal(adv.loss_mask, ro.action_mask)
    assert adv.seq_kl.tolist() == [pytest.approx(3 * 0.5)]  # 3 action tokens, not 5


def test_group_advantages_sit_on_action_tokens_only():
    state, ppo = _state(estimator="grpo", kl_in="loss")
    ro = _rollouts(values=False)
    adv = compute_advantages(ro, state, ppo)
    assert (adv.advantages[~ro.action_mask] == 0).all()
    assert (adv.advantages[0][ACTIONS[0]] > 0).all() and (adv.advantages[1][ACTIONS[1]] < 0).all()
    assert torch.equal(adv.loss_mask, ro.action_mask)


def test_metrics_count_actions_for_values_and_every_token_for_the_length():
    state, _ = _state()
    ro = _rollouts(values=True)
    adv = Advantages(torch.zeros(2, 5), torch.ones(2, 5), torch.zeros(2), ro.action_mask)
    plan = BatchPlan(world_size=1, num_rollouts=2, chunk_size=2, local_counts=(2,), rounds=1, num_minibatches=1,
                     epochs=1)
    upd = {k: 1.0 for k in UPDATE_STATS} | {"grad_norm": 0.5, "steps": 1.0, "skipped": 0.0, "time": 1.0}
    m = iteration_metrics(ro, adv, StepStats(), upd, ["r"], state, plan)
    assert m["policy/response_length"] == (5 + 3) / 2  # what the model saw after the prompt
    assert m["value/mean"] == 0.5  # values over the 5 action tokens only (9.0 elsewhere)
