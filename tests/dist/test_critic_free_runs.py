"""GRPO / RLOO on 2 processes (gloo): the earlier guarantees hold with groups that straddle ranks.

12 rollouts of 3 prompts x G = 4 over 2 ranks (6 + 6): group 1 (samples 4..7) has two members on each
rank, and chunk_size 4 cuts it across chunk rounds too; no per-rank divisibility by G is needed.

- A/B/C: `grpo` with a reference (beta 0.05, KL in the reward) under `main` (reward.batch_size 5),
  `local` with a reward that draws from the global RNGs, and `collective`: final weights byte-identical
  (the group statistics are the same wherever the reward ran), and each advantage in rollouts.jsonl is
  the group formula applied to that group's rewards minus beta x KL, by hand.
- D/E: `rloo` with KL in the loss (k3) and clip-higher: SIGKILL mid-run + `resume: latest` is
  bit-identical to the uninterrupted run; a resume with another `samples_per_prompt` is refused by name.
"""

from __future__ import annotations

import statistics

import pytest
import torch
from safetensors.torch import load_file

from rallyrl.run.logs import read_jsonl
from tests.helpers.runs import base_config, kill_when_paused, rallyrl_train, resume_latest, write_config

pytestmark = pytest.mark.dist

BETA = 0.05


def _cfg(model, run_dir, reward, ppo, **sections):
    return base_config(model, run_dir, rollout={"num_rollouts": 12, "chunk_size": 4, "samples_per_prompt": 4},
                       ppo={"epochs": 2, "num_minibatches": 2, "lr": 1e-3, **ppo}, reward=reward, **sections)


@pytest.fixture(scope="module")
def grpo_runs(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grpo")
    fn, ppo = "tests.helpers.rewards:", {"estimator": "grpo", "init_kl_coef": BETA}
    out = {}
    for name, reward in (("A", {"fn": fn + "hashed", "placement": "main", "batch_size": 5}),
                         ("B", {"fn": fn + "hashed_noisy", "placement": "local"}),
                         ("C", {"fn": fn + "hashed_sharded", "placement": "collective", "batch_size": 5})):
        proc = rallyrl_train(write_config(tmp / f"{name}.yaml", _cfg(tiny_model, tmp / name, reward, ppo)), 2)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[name] = tmp / name
    return out


def test_grpo_is_bit_identical_across_placements(grpo_runs):
    weights = {k: (d / "final" / "model.safetensors").read_bytes() for k, d in grpo_runs.items()}
    assert weights["A"] == weights["B"] == weights["C"]
    strip = lambda rows: [(r["step"], r["index"], r["group"], r["reward"], r["advantage"]) for r in rows]  # noqa: E731
    assert strip(read_jsonl(grpo_runs["A"] / "rollouts.jsonl")) == strip(read_jsonl(grpo_runs["C"] / "rollouts.jsonl"))


def test_groups_straddle_ranks_and_advantages_are_the_group_formula(grpo_runs):
    rows = read_jsonl(grpo_runs["A"] / "rollouts.jsonl")
    for step in (1, 2):
        mine = sorted((r for r in rows if r["step"] == step), key=lambda r: r["index"])
        assert [r["group"] for r in mine] == [i // 4 for i in range(12)]
        assert {r["rank"] for r in mine if r["group"] == 1} == {0, 1}  # group 1 lives on both ranks
        for g in range(3):
            members = [r for r in mine if r["group"] == g]
            assert len({r["prompt"] for r in members}) == 1
            shaped = [r["reward"] - BETA * r["kl"] for r in members]  # k1 summed over the sequence
            mean, std = statistics.mean(shaped), statistics.stdev(shaped)
            for r, s in zip(members, shaped):
                assert r["advantage"] == pytest.approx((s - mean) / max(std, 1e-4), rel=1e-4, abs=1e-5)
    metrics = read_jsonl(grpo_runs["A"] / "metrics.jsonl")
    assert all("policy/kl" in m and not any(k.startswith("value/") for k in m) for m in metrics)


def _rloo(model, run_dir, **rollout):
    cfg = _cfg(model, run_dir, {"fn": "tests.helpers.rewards:hashed_with_crashes"},
               {"estimator": "rloo", "init_kl_coef": 0.1, "kl_in": "loss", "kl_estimator": "k3",
                "clip_range_high": 0.28, "loss_aggregation": "seq_mean_token_sum"},
               train={"iterations": 4}, checkpoint={"interval": 1, "keep_last": 2})
    cfg["rollout"].update(rollout)
    return cfg


def test_rloo_resume_after_sigkill_is_bit_identical(tiny_model, tmp_path):
    ref = rallyrl_train(write_config(tmp_path / "d.yaml", _rloo(tiny_model, tmp_path / "D")), 2)
    assert ref.returncode == 0, ref.stderr[-3000:]
    # 12 samples, chunk 4: 2 rounds per iteration on each rank, so reward call 6 is iteration 3's second
    cmd, e = kill_when_paused(write_config(tmp_path / "e.yaml", _rloo(tiny_model, tmp_path / "E")), 2,
                              tmp_path / "calls", pause_at=6)
    resume_latest(cmd, e)
    a, b = (load_file(tmp_path / x / "final" / "model.safetensors") for x in ("D", "E"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert read_jsonl(tmp_path / "D" / "rollouts.jsonl") == read_jsonl(tmp_path / "E" / "rollouts.jsonl")

    # the same run dir resumed with another group size is refused, naming the key
    changed = write_config(tmp_path / "f.yaml", _rloo(tiny_model, tmp_path / "E", samples_per_prompt=6))
    proc = rallyrl_train(changed, 2, "--set", "train.resume=latest", "--set", "train.iterations=5")
    assert proc.returncode != 0 and "rollout.samples_per_prompt: 4 -> 6" in proc.stderr, proc.stderr[-2000:]


def test_grpo_under_fsdp_trains_like_ddp(tiny_model, tmp_path):
    """FSDP2 with no value head and a sharded reference (KL in the loss): the same samples, advantages
    and update as ddp within float tolerance."""
    runs = {}
    for sharding in ("ddp", "fsdp"):
        cfg = _cfg(tiny_model, tmp_path / sharding, {"fn": "tests.helpers.rewards:hashed"},
                   {"estimator": "grpo", "init_kl_coef": 0.05, "kl_in": "loss", "kl_estimator": "k3"})
        cfg["model"]["sharding"] = sharding
        proc = rallyrl_train(write_config(tmp_path / f"{sharding}.yaml", cfg), 2)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[sharding] = tmp_path / sharding
    ra, rb = (read_jsonl(runs[s] / "rollouts.jsonl") for s in ("ddp", "fsdp"))
    assert [(r["index"], r["output"]) for r in ra] == [(r["index"], r["output"]) for r in rb]
    assert [r["advantage"] for r in rb] == pytest.approx([r["advantage"] for r in ra], rel=1e-4, abs=1e-5)
    for a, b in zip(*(read_jsonl(runs[s] / "metrics.jsonl") for s in ("ddp", "fsdp"))):
        for k in ("policy/loss", "policy/kl_loss", "policy/grad_norm", "policy/kl", "reward/group_std"):
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-5), (k, a[k], b[k])
        assert 0.4 < b["memory/params_bytes"] / a["memory/params_bytes"] < 0.6


def test_grpo_with_a_reward_model_on_the_main_rank_only(tiny_model, tmp_path):
    """Under grpo too, `main` placement loads the reward model on rank 0 alone: rank 1 makes no load and
    no call (the group statistics need every score, and they come back from the reward host)."""
    import json

    from tests.helpers.rewards import build_tiny_classifier

    clf = build_tiny_classifier(tmp_path / "clf", tiny_model)
    loads = tmp_path / "loads"
    loads.mkdir()
    reward = {"placement": "main", "fn": "tests.helpers.rewards:counted_classifier",
              "kwargs": {"log_dir": str(loads), "path": str(clf), "label": "POS", "device": "cpu"}}
    cfg = _cfg(tiny_model, tmp_path / "run", reward, {"estimator": "grpo", "init_kl_coef": 0.0})
    proc = rallyrl_train(write_config(tmp_path / "c.yaml", cfg), 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = {int(p.stem[4:]): json.loads(p.read_text()) for p in loads.glob("rank*.json")}
    assert (ranks[0]["loads"], ranks[0]["model_loaded"]) == (1, True) and ranks[0]["calls"] > 0
    assert (ranks[1]["loads"], ranks[1]["calls"], ranks[1]["model_loaded"]) == (0, 0, False)
    rows = read_jsonl(tmp_path / "run" / "rollouts.jsonl")
    assert {r["rank"] for r in rows} == {0, 1} and all(r["advantage"] is not None for r in rows)
