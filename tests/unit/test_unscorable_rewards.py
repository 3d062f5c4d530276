"""``None`` = unscorable (TRL #5902): a sample every reward function returned None for has no reward. It is
left out of its group's statistics and gets advantage 0 (``grpo``/``rloo``), is left out of the update
(``gae``), of ``reward/mean`` / ``reward/std`` and of the running reward statistics, and is counted in
``reward/unscorable``. One function's None among several means "no say" (TRL's nansum). Values below
are worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from rallyrl import ops
from rallyrl.config import BatchPlan, load_config
from rallyrl.learn.advantages import compute_advantages
from rallyrl.learn.metrics import iteration_metrics
from rallyrl.learn.state import TrainState
from rallyrl.learn.update import UPDATE_STATS
from rallyrl.reward import NamedRewardFn, Reward, RewardStep, Samples, StepStats
from rallyrl.reward.scoring import score_samples
from rallyrl.rollout import Advantages, Episodes, Rollouts, Scored, pad


def some_none(samples, prompts, outputs, **kw):  # None for outputs starting with "?"
    return [None if o.startswith("?") else float(len(o)) for o in outputs]


def dense_or_none(samples, prompts, outputs, **kw):
    return [None if o.startswith("?") else [0.5] * len(t) for o, t in zip(outputs, kw["output_token_ids"])]


def _samples(outputs):
    return Samples(["p"] * len(outputs), outputs, [[1] * max(1, len(o)) for o in outputs], [{} for _ in outputs])


# ---- combining functions --------------------------------------------------------------------------


def test_one_function_none_makes_the_sample_unscorable():
    rewards, _ = score_samples([NamedRewardFn("f", some_none)], _samples(["ab", "?x", "c"]), None, None)
    assert [(r.scorable, r.total, r.components) for r in rewards] == [
        (True, 2.0, {"f": 2.0}), (False, None, {}), (True, 1.0, {"f": 1.0})]


def test_with_several_functions_none_is_no_say_and_all_none_is_unscorable():
    always = lambda s, p, o, **kw: [1.0] * len(s)  # noqa: E731
    rewards, _ = score_samples([NamedRewardFn("f", some_none, 2.0), NamedRewardFn("g", always, 0.5)],
                               _samples(["ab", "?x"]), None, None)
    # sample 0: 2 * 2 + 0.5 * 1; sample 1: f has no say -> 0.5 * 1 only (TRL: nansum over the functions)
    assert [(r.score, r.components, r.scorable) for r in rewards] == [(4.5, {"f": 2.0, "g": 1.0}, True),
                                                                    (0.5, {"g": 1.0}, True)]
    rewards, _ = score_samples([NamedRewardFn("f", some_none), NamedRewardFn("d", dense_or_none, 2.0)],
                               _samples(["ab", "?xy"]), None, None)
    assert (rewards[0].score, rewards[0].dense, rewards[0].total) == (2.0, [1.0, 1.0], 4.0)
    assert not rewards[1].scorable and rewards[1].dense is None and rewards[1].total is None


def test_every_placement_carries_unscorable_at_world_size_one():
    for placement in ("main", "local", "collective"):
        rewards, _ = RewardStep([NamedRewardFn("f", some_none)], placement, batch_size=1)(_samples(["?", "ab"]))
        assert [r.scorable for r in rewards] == [False, True] and rewards[1].score == 2.0, placement


# ---- the reward server, both protocols, and overlap -----------------------------------------------


@pytest.fixture
def served():
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from rallyrl.reward.server import Batcher, create_app

    def trl_style(prompts, completions, completion_ids, **kw):
        answer = kw.get("answer", kw.get("labels"))  # OpenRLHF's requests carry `labels`
        return [None if a is None else float(c == a) for c, a in zip(completions, answer)]

    with TestClient(create_app(Batcher(NamedRewardFn("trl_style", trl_style, signature="trl"), max_wait_ms=0))) as c:
        yield c


def test_the_rallyrl_protocol_carries_null_and_the_client_returns_none(served):
    from rallyrl.reward.client import RemoteReward

    body = {"samples": ["pa", "pb", "pc"], "prompts": ["p"] * 3, "outputs": ["a", "b", "c"],
            "metadata": {"answer": ["a", None, "x"]}, "output_token_ids": [[1], [2], [3]]}
    r = served.post("/score", json=body)
    assert r.status_code == 200 and r.json() == {"rewards": [1.0, None, 0.0]}
    remote = RemoteReward("http://testserver", retries=0)
    remote._client = served  # FastAPI's TestClient is an httpx.Client: the real request path
    rewards, _ = RewardStep([NamedRewardFn("remote", remote)], "main")(
        Samples(["p"] * 3, ["a", "b", "c"], [[1], [2], [3]], [{"answer": a} for a in ("a", None, "x")]))
    assert [(r.scorable, r.score) for r in rewards] == [(True, 1.0), (False, 0.0), (True, 0.0)]


def test_openrlhfs_protocol_cannot_carry_none(served):
    from rallyrl.reward.client import RemoteReward, RemoteRewardError

    r = served.post("/get_reward", json={"query": ["pa", "pb"], "prompts": ["p", "p"], "labels": ["a", None]})
    assert r.status_code == 422
    assert r.json()["field"] == "rewards[1]" and "OpenRLHF's protocol (POST /get_reward) cannot carry None" in \
        r.json()["error"] and "use POST /score (reward.protocol: rallyrl)" in r.json()["error"]
    remote = RemoteReward("http://testserver", retries=2, protocol="openrlhf", backoff_s=0.0)
    remote._client = served
    with pytest.raises(RemoteRewardError, match=r"HTTP 422: .*cannot carry None.*\(not retried"):
        remote(["pa", "pb"], ["p", "p"], ["a", "b"], labels=["a", None])
    assert len(remote.failed_attempts) == 0


def test_the_server_refuses_a_column_named_like_an_argument_of_its_function(served):
    body = {"samples": ["pa"], "prompts": ["p"], "outputs": ["a"], "metadata": {"answer": ["a"], "completions": [1]}}
    r = served.post("/score", json=body)
    assert r.status_code == 422 and r.json()["field"] == "metadata.completions"
    assert "is the name of an argument the served reward function gets (prompts, completions, completion_ids)" in \
        r.json()["error"]


def test_overlap_collects_unscorable_rewards(served):
    from rallyrl.reward.client import RemoteReward

    remote = RemoteReward("http://testserver", retries=0)
    remote._client = served
    step = RewardStep([NamedRewardFn("remote", remote)], "main", overlap=True)
    try:
        handles = [step.submit(Samples(["p"] * 2, out, [[1], [2]], [{"answer": a} for a in ans]))
                   for out, ans in ((["a", "b"], ["a", None]), (["c", "d"], [None, None]))]
        (r0, _), (r1, _) = step.collect(handles)
    finally:
        step.close()
    assert [r.scorable for r in r0 + r1] == [True, False, False, False] and r0[0].score == 1.0


# ---- group advantages, by hand --------------------------------------------------------------------

# group 0: 1, 2, (9: unscorable), 3; group 1: (5), (5): no scorable member; group 2: 4, (0)
S = torch.tensor([1.0, 2.0, 9.0, 3.0, 5.0, 5.0, 4.0, 0.0])
G = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2])
OK = torch.tensor([True, True, False, True, False, False, True, False])


def test_grpo_over_the_scorable_members_only():
    adv, zero, std = ops.group_advantages(S, G, "grpo", "group", scorable=OK)
    # group 0 over 1, 2, 3: mean 2, unbiased std 1 -> -1, 0, 1 (the 9 is not in it); group 1: nothing scorable
    # -> 0, zero-std; group 2: one scorable member, no baseline -> 0
    assert adv.tolist() == [-1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert zero.tolist() == [False, False, False, False, True, True, True, True]
    assert std.tolist() == [1.0, 0.0, 0.0]


def test_grpo_batch_std_and_rloo_over_the_scorable_members_only():
    adv, _, _ = ops.group_advantages(S, G, "grpo", "batch", scorable=OK)
    # scorable scores 1, 2, 3, 4: mean 2.5, unbiased variance (2.25 + 0.25 + 0.25 + 2.25) / 3 = 5 / 3
    s = math.sqrt(5 / 3)
    assert adv.tolist() == pytest.approx([-1 / s, 0.0, 0.0, 1 / s, 0.0, 0.0, 0.0, 0.0], abs=1e-12)
    adv, _, _ = ops.group_advantages(S, G, "rloo", scorable=OK)
    # 1 - (2 + 3) / 2 = -1.5; 2 - (1 + 3) / 2 = 0; 3 - (1 + 2) / 2 = 1.5; the rest 0
    assert adv.tolist() == [-1.5, 0.0, 0.0, 1.5, 0.0, 0.0, 0.0, 0.0]


def test_all_scorable_gives_the_same_bits_as_no_mask():
    for est, scale in (("grpo", "group"), ("grpo", "batch"), ("rloo", "group")):
        plain = ops.group_advantages(S, G, est, scale)
        masked = ops.group_advantages(S, G, est, scale, scorable=torch.ones(8, dtype=torch.bool))
        assert all(torch.equal(a, b) for a, b in zip(plain, masked)), est


# ---- the stages after the reward: advantages and metrics ------------------------------------------


def _rollouts(rewards, values: bool):
    n = len(rewards)
    q, qm = pad([[1, 2]] * n, 0, left=True)
    r, rm = pad([[5, 6, 7]] * n, 0, left=False)
    lp = torch.full((n, 3), -1.0)
    ep = Episodes(q, qm, r, rm, rm, [[5, 6, 7]] * n, ["o"] * n)
    sc = Scored(logprobs=lp, ref_logprobs=lp - 0.5, values=torch.full((n, 3), 0.25) if values else None)
    return Rollouts.from_chunk(ep, sc, rewards, ["p"] * n, [{}] * n, list(range(n)), group_size=n)


def _state(**ppo):
    cfg = load_config({"train": {"run_dir": "unused"}, "ppo": {"init_kl_coef": 0.1, **ppo},
                       "rollout": {"num_rollouts": 4, "samples_per_prompt": 4 if ppo.get("estimator") else 1}})
    return TrainState.fresh(cfg, num_prompts=4, shuffle_seed=0), cfg.ppo


REWARDS = [Reward(1.0, components={"f": 1.0}), Reward(0.0, scorable=False), Reward(3.0, components={"f": 3.0}),
           Reward(2.0, components={"f": 2.0, "g": 4.0})]


def test_rollouts_carry_scorable_only_when_some_sample_is_not():
    assert _rollouts([Reward(1.0), Reward(2.0)], values=False).scorable is None
    ro = Rollouts.concat([_rollouts([Reward(1.0)], False), _rollouts([Reward(0.0, scorable=False)], False)], 0)
    assert ro.scorable.tolist() == [True, False]


def test_grpo_unscorable_gets_zero_advantage_and_stays_in_the_loss_as_in_trl():
    state, ppo = _state(estimator="grpo", kl_in="loss")
    ro = _rollouts(REWARDS, values=False)
    adv = compute_advantages(ro, state, ppo)
    # one group, scorable 1, 3, 2: mean 2, std 1
    assert adv.seq_advantages == [-1.0, 0.0, 1.0, 0.0]
    assert torch.equal(adv.loss_mask, ro.action_mask)
    assert adv.stats["reward/zero_std_groups"] == 0.0 and adv.stats["reward/group_std"] == 1.0


def test_gae_leaves_an_unscorable_sample_out_of_the_update():
    state, ppo = _state(whiten_advantages=True, reward_scaling="running")
    ro = _rollouts(REWARDS, values=True)
    adv = compute_advantages(ro, state, ppo)
    assert adv.loss_mask.tolist() == [[True] * 3, [False] * 3, [True] * 3, [True] * 3]
    assert (adv.advantages[1] == 0).all() and (adv.returns[1] == 0).all()
    assert adv.seq_kl.tolist() == [1.5] * 4  # the KL of what the policy sampled, unscorable or not
    # the running reward statistics saw the three rewards only: 1, 3, 2 (mean 2, population variance 2/3)
    assert state.reward_moments.mean == pytest.approx(2.0) and state.reward_moments.count == 3
    # whitening over the three kept rows only: their whitened advantages have mean 0 over their 9 tokens
    assert float(adv.advantages[[0, 2, 3]].mean()) == pytest.approx(0.0, abs=1e-6)


def test_metrics_leave_unscorable_out_of_reward_mean_and_count_it():
    state, ppo = _state()
    ro = _rollouts(REWARDS, values=True)
    adv = Advantages(torch.zeros(4, 3), torch.zeros(4, 3), torch.zeros(4), ro.action_mask)
    plan = BatchPlan(world_size=1, num_rollouts=4, chunk_size=4, local_counts=(4,), rounds=1, num_minibatches=1,
                     epochs=1)
    upd = {k: 1.0 for k in UPDATE_STATS} | {"grad_norm": 0.5, "steps": 1.0, "skipped": 0.0, "time": 1.0}
    m = iteration_metrics(ro, adv, StepStats(), upd, ["f", "g"], state, plan)
    assert m["reward/unscorable"] == 1.0
    assert m["reward/mean"] == 2.0 and m["reward/std"] == pytest.approx(1.0)  # over 1, 3, 2
    assert m["reward/f"] == 2.0 and m["reward/g"] == 4.0  # each over the samples it scored
    assert m["policy/response_length"] == 3.0  # per-sample statistics still count every sample
    none = _rollouts([Reward(0.0, scorable=False)] * 4, values=True)
    m = iteration_metrics(none, adv, StepStats(), upd, ["f"], state, plan)
    assert math.isnan(m["reward/mean"]) and math.isnan(m["reward/std"]) and m["reward/unscorable"] == 4.0
