"""None (unscorable) rewards on 2 processes (gloo), from a reward function written for TRL: GRPO with groups
that straddle the ranks, the reward under `main` placement (gathered to rank 0, None scattered back to the
rank that owns the sample) and behind `reward.server: local` with `reward.overlap` (None as JSON null over
HTTP, collected in the background). The two runs are bit-identical (how None travelled changes nothing),
and each advantage is GRPO over its group's scorable members. (`local` and `collective` carry the same
Reward objects through `dist.agree`: tests/unit/test_unscorable_rewards.py.)"""

from __future__ import annotations

import statistics

import pytest

from rallyrl.run.logs import read_jsonl
from tests.helpers.runs import base_config, rallyrl_train, write_config

pytestmark = pytest.mark.dist

PROMPTS = [{"prompt": w, "answer": a} for w, a in (("the cat", "a"), ("a dog", "o"), ("good morning", "g"),
                                                   ("i like", None))]
RUNS = {"main": {"placement": "main", "batch_size": 5}, "server": {"server": "local", "overlap": True}}


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("unscorable")
    out = {}
    for name, reward in RUNS.items():
        cfg = base_config(tiny_model, tmp / name, data={"prompts": PROMPTS},
                          rollout={"num_rollouts": 12, "chunk_size": 4, "samples_per_prompt": 4},
                          ppo={"estimator": "grpo", "kl_in": "loss", "init_kl_coef": 0.05},
                          reward={"fn": "tests.helpers.rewards:trl_unscorable", **reward})
        proc = rallyrl_train(write_config(tmp / f"{name}.yaml", cfg), 2)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[name] = tmp / name
    return out


def test_none_reaches_the_rank_that_owns_the_sample_and_gets_advantage_zero(runs):
    rows = read_jsonl(runs["main"] / "rollouts.jsonl")
    unscorable = [r for r in rows if r["reward"] is None]
    assert {r["rank"] for r in unscorable} == {0, 1}  # None was scattered to both ranks
    assert all(r["advantage"] == 0.0 for r in unscorable)
    metrics = {m["step"]: m for m in read_jsonl(runs["main"] / "metrics.jsonl")}
    checked = 0
    for step in (1, 2):
        mine = [r for r in rows if r["step"] == step]
        assert metrics[step]["reward/unscorable"] == sum(r["reward"] is None for r in mine)
        for g in {r["group"] for r in mine}:
            members = [r for r in mine if r["group"] == g and r["reward"] is not None]
            if len(members) > 1 and len({r["reward"] for r in members}) > 1:
                values = [r["reward"] for r in members]
                mean, std = statistics.mean(values), statistics.stdev(values)
                for r in members:
                    assert r["advantage"] == pytest.approx((r["reward"] - mean) / std, rel=1e-4, abs=1e-5)
                checked += 1
    assert checked >= 2


def test_the_reward_server_with_overlap_is_bit_identical_to_main(runs):
    weights = {k: (d / "final" / "model.safetensors").read_bytes() for k, d in runs.items()}
    assert weights["main"] == weights["server"]
    strip = lambda rows: [(r["step"], r["index"], r["reward"], r["advantage"]) for r in rows]  # noqa: E731
    logged = {k: sorted(strip(read_jsonl(d / "rollouts.jsonl"))) for k, d in runs.items()}
    assert logged["main"] == logged["server"]
