"""The objectives of issue 29 end to end on a tiny GPT-2 (1 process, 2 iterations each): GSPO with a dual clip,
DAPO's dynamic sampling and overlong penalty together; CISPO; the loss variants under `gae`; and truncated
responses masked out of the loss."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import rallyrl
from rallyrl.tracking import read_jsonl
from tests.helpers.runs import base_config

pytestmark = pytest.mark.smoke

G = 4


def _cfg(model_path, run_dir, **sections):
    kw = {"rollout": {"num_rollouts": 12, "chunk_size": 6, "samples_per_prompt": G},
          "ppo": {"estimator": "grpo", "init_kl_coef": 0.0, "epochs": 1, "lr": 1e-2},
          "reward": {"fn": "tests.helpers.rewards:hashed_pass_fail"}}
    for k, v in sections.items():
        kw[k] = {**kw.get(k, {}), **v}
    return base_config(model_path, run_dir, **kw)


def _moved(run, model_path) -> bool:
    before, after = load_file(model_path / "model.safetensors"), load_file(run / "final" / "model.safetensors")
    return any(not torch.equal(before[k], after[k]) for k in after if k in before)


def test_gspo_dual_clip_dynamic_sampling_and_overlong_together(tiny_model, tmp_path):
    run = tmp_path / "dapo"
    rallyrl.train(_cfg(tiny_model, run, rollout={"dynamic_sampling": True, "max_sampling_rounds": 3},
                       ppo={"ratio_level": "sequence", "loss_aggregation": "seq_mean_token_mean", "dual_clip": 3.0},
                       reward={"overlong_buffer": {"length": 3, "penalty": 0.5}}))
    metrics, rows = read_jsonl(run / "metrics.jsonl"), read_jsonl(run / "rollouts.jsonl")
    for step, m in enumerate(metrics, 1):
        assert 1 <= m["rollout/sampling_rounds"] <= 3 and m["rollout/groups_unused"] >= 0
        # the penalty is a reward component of its own, in [-0.5, 0], and part of the logged reward
        assert -0.5 <= m["reward/overlong"] <= 0.0
        assert m["reward/mean"] == pytest.approx(m["reward/hashed_pass_fail"] + m["reward/overlong"])
        kept = 3 - int(m["rollout/short_groups"])
        mine = sorted((r for r in rows if r["step"] == step), key=lambda r: r["index"])
        assert [r["group"] for r in mine] == [i // G for i in range(12)]
        for g in range(kept):  # every trained group's rewards differ (the penalty included)
            assert len({r["reward"] for r in mine if r["group"] == g}) > 1
    assert _moved(run, tiny_model)


@pytest.mark.parametrize("name, sections", [
    ("cispo", {"ppo": {"policy_loss": "cispo", "cispo_clip_high": 0.2, "epochs": 2}}),
    ("gae", {"rollout": {"samples_per_prompt": 1}, "reward": {"fn": "tests.helpers.rewards:hashed"},
             "ppo": {"estimator": "gae", "ratio_level": "sequence", "loss_aggregation": "seq_mean_token_mean",
                     "sequence_clip_range": 0.05, "sequence_clip_range_high": 0.05, "dual_clip": 2.0, "epochs": 2}}),
])
def test_the_loss_variants_train(tiny_model, tmp_path, name, sections):
    run = tmp_path / name
    rallyrl.train(_cfg(tiny_model, run, **sections))
    for m in read_jsonl(run / "metrics.jsonl"):
        assert 0.0 <= m["policy/clipfrac"] <= 1.0 and m["policy/grad_norm"] > 0
    assert _moved(run, tiny_model)


def test_truncated_responses_leave_the_loss(tiny_model, tmp_path):
    # one new token and no stop: every response is cut by max_new_tokens (unless its one token is EOS)
    run = tmp_path / "masked"
    rallyrl.train(_cfg(tiny_model, run, generation={"max_new_tokens": 1}, ppo={"mask_truncated": True}))
    metrics = read_jsonl(run / "metrics.jsonl")
    assert [m["rollout/truncated"] for m in metrics] == [1.0, 1.0]
    # nothing in the loss: zero gradients, and AdamW's first steps from zero moments move nothing
    assert all(m["policy/grad_norm"] == 0 for m in metrics) and not _moved(run, tiny_model)
