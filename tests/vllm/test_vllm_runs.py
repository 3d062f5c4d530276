"""Real short runs with `generation.engine: vllm` on a tiny GPT-2 (in .venv-vllm; skipped elsewhere):
2-process GRPO under fsdp, PPO with eval and an exact resume, GRPO with LoRA, a bfloat16 engine and the
`tis` correction, and multi-turn episodes (an environment) on 2 processes. The central reward step is the
usual one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import rallyrl
from tests.helpers.runs import base_config, rallyrl_train, write_config

pytestmark = pytest.mark.vllm
VLLM = {"engine": "vllm", "vllm": {"kv_cache_gib": 0.25}}


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _rollouts(run, step):
    return [r for r in map(json.loads, (run / "rollouts.jsonl").read_text().splitlines()) if r["step"] == step]


def test_two_process_grpo_under_fsdp(tiny_model, tmp_path):
    run = tmp_path / "run"
    cfg = base_config(tiny_model, run, generation={"max_new_tokens": 5, **VLLM},
                      rollout={"num_rollouts": 8, "samples_per_prompt": 2, "chunk_size": 2},
                      ppo={"estimator": "grpo", "init_kl_coef": 0.0, "epochs": 1})
    cfg["model"]["sharding"] = "fsdp"
    done = rallyrl_train(write_config(tmp_path / "c.yaml", cfg), 2, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    m = _metrics(run)
    assert [x["step"] for x in m] == [1, 2]
    for x in m:  # every sample from the current weights; the engine agrees with the trainer (float32)
        assert x["engine/version_lag"] == 0 and x["engine/logprob_abs_diff_max"] < 1e-3
        assert x["engine/probe_abs_diff_mean"] < 1e-4
    assert len(_rollouts(run, 2)) == 8  # every rank's samples went through the one central reward step


def test_ppo_with_eval_resumes_exactly(tiny_model, tmp_path):
    kw = dict(generation={"max_new_tokens": 5, **VLLM}, checkpoint={"interval": 1, "keep_last": 3},
              data={"eval_prompts": ["the cat", "a dog", "my friend"]}, eval={"interval": 1, "do_sample": True})
    rallyrl.train(base_config(tiny_model, tmp_path / "full", train={"iterations": 2}, **kw))
    # a run "killed" after iteration 1: its checkpoint, then resumed with a fresh engine built from it
    rallyrl.train(base_config(tiny_model, tmp_path / "cut", train={"iterations": 1}, **kw))
    rallyrl.train(base_config(tiny_model, tmp_path / "cut", train={"iterations": 2, "resume": "latest"}, **kw))
    full, cut = _metrics(tmp_path / "full"), _metrics(tmp_path / "cut")
    assert "value/loss" in full[-1] and "eval/reward_mean" in full[-1]  # gae with a value head; eval ran
    assert _rollouts(tmp_path / "cut", 2) == _rollouts(tmp_path / "full", 2)  # the same samples after resume
    for key in ("reward/mean", "policy/loss", "eval/reward_mean", "engine/logprob_abs_diff_mean"):
        assert cut[-1][key] == full[-1][key], key


def test_grpo_lora_bf16_engine_with_tis(tiny_model, tmp_path):
    run = tmp_path / "run"
    cfg = base_config(
        tiny_model, run, generation={"max_new_tokens": 5, **VLLM, "vllm": {"kv_cache_gib": 0.25, "dtype": "bfloat16"}},
        rollout={"num_rollouts": 8, "samples_per_prompt": 2},
        ppo={"estimator": "grpo", "engine_correction": "tis", "engine_correction_cap": 1.5, "lr": 1e-2})
    cfg["model"] |= {"reference": "lora", "lora": {"r": 4}}
    rallyrl.train(cfg)
    m = _metrics(run)
    for x in m:
        # bf16 sampling against a float32 trainer: a visible mismatch, corrected with weights <= the cap
        assert 0 < x["engine/logprob_abs_diff_mean"] < 0.25 and x["engine/probe_abs_diff_mean"] < 0.25
        assert 0 < x["engine/correction_weight_mean"] <= 1.5
    # the merged LoRA weights were pushed: after an lr 1e-2 update the probe still agrees (a stale engine would not)
    assert m[-1]["policy/kl"] > 0
    doc = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    assert not [k for k in m[-1] if k.startswith(("engine/", "time/engine")) and f"`{k}`" not in doc]


def test_multi_turn_episodes_on_two_processes(tiny_chat, tmp_path):
    """The environments' episodes run on the vLLM engine unchanged: every turn is an engine call from the
    row's token ids; ranks run different numbers of turns (Echo(vary=True): 1-3 by prompt), with eval over
    episodes through the same engine. The engine's log-probs line up with the trainer's on every sampled
    token of every turn (float32: a column shifted at a turn boundary would differ by whole nats), and the
    environment's tokens are not compared (action_mask False)."""
    run = tmp_path / "run"
    cfg = base_config(tiny_chat, run, generation={"max_new_tokens": 5, **VLLM},
                      rollout={"num_rollouts": 8, "samples_per_prompt": 2, "chunk_size": 2},
                      ppo={"estimator": "grpo", "init_kl_coef": 0.0, "epochs": 1, "engine_correction": "mask"},
                      reward={"fn": "tests.helpers.envs:episode_reward"},
                      env={"factory": "tests.helpers.envs:Echo", "kwargs": {"turns": 3, "vary": True}},
                      data={"eval_prompts": ["the cat", "a dog", "my friend"]}, eval={"interval": 2})
    done = rallyrl_train(write_config(tmp_path / "c.yaml", cfg), 2, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    m = [x for x in _metrics(run) if x["step"] > 0]
    assert [x["step"] for x in m if "reward/mean" in x] == [1, 2]
    for x in [x for x in m if "reward/mean" in x]:
        assert x["engine/version_lag"] == 0 and x["engine/logprob_abs_diff_max"] < 1e-3
        assert x["engine/correction_zeroed"] == 0  # nothing beyond the mask's threshold in float32
        assert 1 < x["episode/turns"] < 3 and 0 < x["episode/env_token_fraction"] < 1
    assert any("eval/turns" in x for x in m)
    rows = _rollouts(run, 2)
    assert len(rows) == 8  # one line per episode, from both ranks, through the central reward step
    turns = {len(r["episode"]["turns"]) for r in rows}
    assert len(turns) > 1, turns  # episodes (and so ranks) ran different numbers of turns
    for r in rows:
        ep = r["episode"]
        assert r["output"] == "\n".join(t["text"] for t in ep["turns"])
        assert all(t["env_tokens"] > 0 for t in ep["turns"][:-1])  # the environment's reply was appended


def test_an_episode_is_bounded_by_the_engines_max_model_len(tiny_chat, tmp_path):
    """generation.vllm.max_model_len below the model's positions bounds a multi-turn row's context like
    rollout.max_episode_tokens (vLLM refuses a longer context): episodes end as truncated, never a crash."""
    run = tmp_path / "run"
    rallyrl.train(base_config(tiny_chat, run, generation={"max_new_tokens": 5, **VLLM,
                                                          "vllm": {"kv_cache_gib": 0.25, "max_model_len": 40}},
                              rollout={"num_rollouts": 4, "samples_per_prompt": 2, "chunk_size": 4},
                              ppo={"estimator": "grpo", "init_kl_coef": 0.0, "epochs": 1},
                              reward={"fn": "tests.helpers.envs:episode_reward"}, train={"iterations": 1},
                              env={"factory": "tests.helpers.envs:Echo", "kwargs": {"turns": 3}}))
    rows = _rollouts(run, 1)
    assert rows and all(r["episode"]["truncated"] for r in rows)
    assert _metrics(run)[-1]["episode/truncated"] == 1.0
