"""The iteration's statistics reduction: sums of what adds up over ranks, and nothing else."""

import torch

from rallyrl.learn import metrics
from rallyrl.config import BatchPlan, load_config
from rallyrl.reward.step import Reward, StepStats
from rallyrl.rollout import Advantages, Episodes, Rollouts, Scored, pad
from rallyrl.learn.state import TrainState
from rallyrl.learn.update import UPDATE_STATS


def _rollouts():
    q, qm = pad([[1, 2], [3]], 0, left=True)
    r, rm = pad([[5, 6, 7], [8]], 0, left=False)
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-1.5, 0.0, 0.0]])
    g = Episodes(q, qm, r, rm, rm, [[5, 6, 7], [8]], ["a", "b"])
    s = Scored(logprobs=lp, ref_logprobs=lp * 0.5, values=torch.zeros(2, 3))
    return Rollouts.from_chunk(g, s, [Reward(1.0), Reward(3.0)], ["p", "q"], [{}, {}], [0, 1])


def test_the_update_wall_time_is_not_summed_over_ranks(monkeypatch):
    """`time` is each rank's own wall time: a sum over ranks means nothing, so it stays out of the
    all-reduce (the trainer logs the main rank's own value as time/update)."""
    reduced = []
    real = metrics.dist.reduce_stats
    monkeypatch.setattr(metrics.dist, "reduce_stats", lambda stats: reduced.append(dict(stats)) or real(stats))
    cfg = load_config({"train": {"run_dir": "unused"}, "ppo": {"lr": 1e-3}})
    state = TrainState.fresh(cfg, num_prompts=2, shuffle_seed=0)
    plan = BatchPlan(world_size=1, num_rollouts=2, chunk_size=2, local_counts=(2,), rounds=1, num_minibatches=1,
                     epochs=1)
    upd = {k: 1.0 for k in UPDATE_STATS} | {"grad_norm": 0.5, "steps": 1.0, "skipped": 0.0, "time": 12.5}
    ro = _rollouts()
    adv = Advantages(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2), ro.response_mask)
    m = metrics.iteration_metrics(ro, adv, StepStats(), upd, ["r"], state, plan)
    (keys,) = [set(x) for x in reduced]  # one reduction
    assert {f"u_{k}" for k in UPDATE_STATS} | {"u_grad_norm", "u_steps", "u_skipped"} <= keys
    assert "u_time" not in keys
    assert m["reward/mean"] == 2.0 and m["policy/grad_norm"] == 0.5  # the reduction itself still works
