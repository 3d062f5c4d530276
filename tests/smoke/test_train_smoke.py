"""A real 2-iteration single-process PPO run on a tiny GPT-2 built in the test."""


import pytest
import yaml

import rallyrl
from rallyrl.run.logs import read_jsonl
from tests.helpers.rewards import deterministic_score
from tests.helpers.runs import base_config

pytestmark = pytest.mark.smoke

REQUIRED = ["reward/mean", "reward/std", "reward/calls", "reward/samples_per_call", "policy/kl", "policy/kl_coef",
            "policy/loss", "policy/clipfrac", "policy/approx_kl", "policy/entropy", "value/loss", "policy/total_loss",
            "policy/grad_norm", "policy/optimizer_steps", "policy/nonfinite_skips", "time/reward",
            "time/reward_gather", "time/rollout", "time/update", "time/iteration", "policy/lr"]


@pytest.fixture(scope="module")
def run(tiny_model, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("smoke") / "run"
    cfg = base_config(tiny_model, run_dir, data={"eval_prompts": ["the", "a dog", "we"]},
                      train={"tensorboard": True})

    def metric_fn(samples, prompts, outputs, **kw):
        return {"length": [len(o) for o in outputs]}

    result = rallyrl.train(cfg, metric_fn=metric_fn)
    return run_dir, cfg, result


def test_run_directory_contract(run):
    run_dir, cfg, result = run
    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert resolved["rollout"]["num_rollouts"] == 7 and resolved["ppo"]["lr"] == pytest.approx(1e-3)
    rallyrl.load_config(run_dir / "config.yaml")  # the resolved config is itself a valid config

    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in rows] == [0, 1, 2]
    # step 0: the evaluation of the initial policy, so every eval curve starts at the pretrained model
    assert set(rows[0]) == {"step", "eval/reward_mean", "eval/length", "time/eval"}
    assert rows[0]["eval/reward_mean"] == pytest.approx(result.eval_before["eval/reward_mean"])
    metrics = rows[1:]
    for m in metrics:
        missing = [k for k in REQUIRED if k not in m]
        assert not missing, missing
    assert "eval/length" in metrics[-1] and "eval/reward_mean" in metrics[-1]
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert result.eval_before and result.eval_after

    rollouts = read_jsonl(run_dir / "rollouts.jsonl")
    assert len(rollouts) == 2 * 7
    assert {tuple(sorted(r)) for r in rollouts} == {("advantage", "group", "index", "kl", "output", "prompt", "rank", "reward",
                                                  "step")}
    for step in (1, 2):
        rows = [r for r in rollouts if r["step"] == step]
        assert sorted(r["index"] for r in rows) == list(range(7))
        # every sample got the reward of its own (prompt, output)
        for r in rows:
            assert r["reward"] == pytest.approx(deterministic_score(r["prompt"], r["output"]), abs=1e-6)
        m = metrics[step - 1]
        assert m["reward/mean"] == pytest.approx(sum(r["reward"] for r in rows) / 7, rel=1e-5)
        assert m["policy/kl"] == pytest.approx(sum(r["kl"] for r in rows) / 7, rel=1e-4, abs=1e-6)
    # step 1 is collected by the initial policy: its KL to the (identical) reference is exactly 0
    assert metrics[0]["policy/kl"] == 0.0
    assert metrics[0]["reward/calls"] == 4  # ceil(7 / chunk_size 2) chunk rounds, one call each


def test_final_model_loads_with_plain_transformers(run, tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir, _, _ = run
    model = AutoModelForCausalLM.from_pretrained(run_dir / "final")
    tok = AutoTokenizer.from_pretrained(run_dir / "final")
    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert not any("v_head" in k for k in model.state_dict())
    # training changed the weights
    diffs = [(a - b).abs().max().item() for a, b in zip(model.state_dict().values(), base.state_dict().values())]
    assert max(diffs) > 0
    out = model.generate(**tok(["the cat"], return_tensors="pt"), max_new_tokens=3, do_sample=False,
                         pad_token_id=tok.pad_token_id)
    assert out.shape[1] >= 3


def test_first_ppo_step_is_on_policy(run):
    """Rollout log-probs equal the training forward's at the first minibatch (ratio 1): the generation,
    scoring and training passes see identical inputs (padding, positions, temperature)."""
    run_dir, _, _ = run
    m = read_jsonl(run_dir / "metrics.jsonl")[1]
    assert m["step"] == 1 and m["policy/approx_kl"] < 0.5  # averaged over 4 optimizer steps at lr 1e-3


def test_every_logged_metric_is_documented(run):
    """docs/metrics.md names every key that metrics.jsonl carries (so the page cannot drift)."""
    from pathlib import Path

    run_dir, _, _ = run
    doc = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    keys = {k for m in read_jsonl(run_dir / "metrics.jsonl") for k in m if k != "step"}
    generic = {"eval/length"}  # from this test's metric_fn: documented as eval/<name>
    missing = sorted(k for k in keys - generic if f"`{k}`" not in doc)
    assert not missing, f"undocumented metrics: {missing}"
