"""GRPO / RLOO end to end on a tiny GPT-2 (1 process): groups, no value head, no reference at beta 0,
the advantages in rollouts.jsonl, KL in the loss, and the zero-std filter."""

from __future__ import annotations

import statistics

import pytest
import torch
from safetensors.torch import load_file

import rallyrl
from rallyrl.tracking import read_jsonl
from tests.helpers.runs import base_config

pytestmark = pytest.mark.smoke


def _grpo(model_path, run_dir, **sections):
    kw = {"rollout": {"num_rollouts": 8, "chunk_size": 3, "samples_per_prompt": 4},
          "ppo": {"estimator": "grpo", "init_kl_coef": 0.0}}
    for k, v in sections.items():
        kw[k] = {**kw.get(k, {}), **v}
    model = kw.pop("model", {})
    cfg = base_config(model_path, run_dir, **kw)
    cfg["model"].update(model)
    return cfg


def _weights(path):
    return load_file(path / "final" / "model.safetensors")


def test_grpo_groups_advantages_and_no_critic_or_reference(tiny_model, tmp_path):
    run = tmp_path / "grpo"
    rallyrl.train(_grpo(tiny_model, run, checkpoint={"interval": 2}))
    rows = read_jsonl(run / "rollouts.jsonl")
    metrics = read_jsonl(run / "metrics.jsonl")
    for step in (1, 2):
        mine = sorted((r for r in rows if r["step"] == step), key=lambda r: r["index"])
        assert [r["group"] for r in mine] == [0, 0, 0, 0, 1, 1, 1, 1]
        for g in (0, 1):
            members = [r for r in mine if r["group"] == g]
            assert len({r["prompt"] for r in members}) == 1  # G completions of one prompt
            rewards = [r["reward"] for r in members]
            mean, std = statistics.mean(rewards), statistics.stdev(rewards)  # unbiased, as TRL and veRL
            for r in members:
                expected = 0.0 if std == 0 else (r["reward"] - mean) / max(std, 1e-4)
                assert r["advantage"] == pytest.approx(expected, rel=1e-5, abs=1e-6)
                assert r["kl"] is None  # beta 0: no reference at all
        m = metrics[step - 1]
        assert not [k for k in m if k.startswith("value/")] and "policy/kl" not in m
        assert 0.0 <= m["reward/zero_std_groups"] <= 1.0 and m["reward/group_std"] >= 0.0
    # no value head anywhere: not in the checkpoint, not in final/
    ckpt = run / "checkpoints" / "step_2"
    keys = [k for f in ckpt.glob("*.safetensors") for k in load_file(f)]
    assert keys and not [k for k in keys if "v_head" in k]
    assert not [k for k in _weights(run) if "v_head" in k]


def test_the_saving_shows_in_memory_metrics(tiny_model, tmp_path):
    """grpo at beta 0 holds neither a value head nor a reference copy: memory/params_bytes is the
    policy alone (PPO: policy + head + a full reference), memory/optimizer_bytes lacks the head's state."""
    rallyrl.train(_grpo(tiny_model, tmp_path / "g", train={"iterations": 1}))
    rallyrl.train(base_config(tiny_model, tmp_path / "p", train={"iterations": 1}, rollout={"num_rollouts": 8}))
    g, p = read_jsonl(tmp_path / "g" / "metrics.jsonl")[0], read_jsonl(tmp_path / "p" / "metrics.jsonl")[0]
    policy_bytes = sum(t.numel() * t.element_size() for t in _weights(tmp_path / "g").values())
    assert g["memory/params_bytes"] == policy_bytes
    assert p["memory/params_bytes"] > 1.9 * g["memory/params_bytes"]
    # AdamW: 2 moments per weight (+ a 4-byte step counter per tensor); PPO adds the value head's (64 + 1
    # weights on the 64-dim model: 2 x 65 x 4 bytes + 2 counters)
    assert 2 * policy_bytes <= g["memory/optimizer_bytes"] < 2 * policy_bytes + 4 * 64
    assert p["memory/optimizer_bytes"] - g["memory/optimizer_bytes"] == 2 * 65 * 4 + 2 * 4


def test_kl_in_the_loss_and_rloo(tiny_model, tmp_path):
    run = tmp_path / "rloo"
    rallyrl.train(_grpo(tiny_model, run, train={"iterations": 3},
                        ppo={"estimator": "rloo", "init_kl_coef": 0.1, "kl_in": "loss", "kl_estimator": "k3",
                             "loss_aggregation": "seq_mean_token_mean"}))
    m = read_jsonl(run / "metrics.jsonl")
    assert m[0]["policy/kl"] == 0.0  # iteration 1 samples from the reference itself
    assert m[-1]["policy/kl_loss"] > 0.0  # the policy moved, and the KL term with it
    rows = [r for r in read_jsonl(run / "rollouts.jsonl") if r["step"] == 2]
    for g in {r["group"] for r in rows}:
        members = [r for r in rows if r["group"] == g]
        total = sum(r["reward"] for r in members)
        for r in members:  # KL is in the loss, so the baseline is of the raw rewards
            expected = r["reward"] - (total - r["reward"]) / (len(members) - 1)
            if len({x["reward"] for x in members}) == 1:
                expected = 0.0
            assert r["advantage"] == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_dropped_zero_std_groups_leave_no_gradient(tiny_model, tmp_path):
    """A constant reward makes every group zero-std: advantage 0 everywhere, and with the filter the
    loss has no term at all, so the weights do not move (beta 0, no entropy bonus)."""
    for name, drop in (("keep", False), ("drop", True)):
        rallyrl.train(_grpo(tiny_model, tmp_path / name, reward={"fn": "tests.helpers.rewards:constant"},
                            ppo={"drop_zero_std_groups": drop}, train={"iterations": 1}))
    m = read_jsonl(tmp_path / "drop" / "metrics.jsonl")[0]
    assert m["reward/zero_std_groups"] == 1.0 and m["policy/loss"] == 0.0 and m["policy/grad_norm"] == 0.0
    # the entropy is the policy's over every sampled token, in the loss or not: not a false "collapse" to 0
    kept = read_jsonl(tmp_path / "keep" / "metrics.jsonl")[0]
    assert m["policy/entropy"] > 1.0 and m["policy/entropy"] == pytest.approx(kept["policy/entropy"], rel=1e-6)
    assert all(r["advantage"] == 0.0 for r in read_jsonl(tmp_path / "drop" / "rollouts.jsonl"))
    from transformers import AutoModelForCausalLM

    initial = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    after = _weights(tmp_path / "drop")
    assert all(torch.equal(after[k], initial[k]) for k in after)


def test_bad_group_settings_fail_before_any_work(tiny_model, tmp_path):
    with pytest.raises(rallyrl.ConfigError, match="rollout.samples_per_prompt"):
        rallyrl.train(_grpo(tiny_model, tmp_path / "x", rollout={"num_rollouts": 10}))
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("model_cfg", [{"reference": "shared", "num_layers_unfrozen": 1},
                                       {"reference": "lora", "lora": {"r": 4}}], ids=["shared", "lora"])
def test_beta_zero_keeps_what_trains_but_builds_no_reference(tiny_model, tmp_path, model_cfg):
    """`shared` still trains only the top block, `lora` only the adapter; neither builds its reference,
    and logprobs_from=generate works without a value head."""
    from rallyrl.config import load_config
    from rallyrl.models import load_models

    cfg = load_config(_grpo(tiny_model, tmp_path / "r", model=model_cfg))
    m = load_models(cfg.model, seed=0, value_head=False, reference=False)
    assert m.reference is None and m.policy.v_head is None
    trainable = [n for n, p in m.policy.named_parameters() if p.requires_grad]
    frozen = [n for n, p in m.policy.named_parameters() if not p.requires_grad]
    assert trainable and frozen  # the same split as with a reference
    if model_cfg["reference"] == "lora":
        assert all("lora_" in n for n in trainable)
    rallyrl.train(_grpo(tiny_model, tmp_path / "run", model=model_cfg, rollout={"logprobs_from": "generate"}))
    assert len(read_jsonl(tmp_path / "run" / "metrics.jsonl")) == 2


def test_seq2seq_grpo(tmp_path):
    from rallyrl.testing import build_tiny_t5

    t5 = build_tiny_t5(tmp_path / "t5")
    run = tmp_path / "run"
    rallyrl.train(_grpo(t5, run, model={"arch": "seq2seq"}, ppo={"init_kl_coef": 0.05, "kl_in": "loss",
                                                               "kl_estimator": "k3"}))
    m = read_jsonl(run / "metrics.jsonl")
    assert m[0]["policy/kl"] == 0.0 and not [k for k in m[-1] if k.startswith("value/")]
    assert not [k for k in _weights(run) if "v_head" in k]
