"""Multi-turn episodes end to end on a tiny chat model (1 process): an environment through train(env=)
and through env.factory in YAML, GRPO and PPO (gae) over turns, the transcript in rollouts.jsonl, the
episode/* metrics, eval over episodes, exact resume, and an environment failure stopping the run."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import rallyrl
from rallyrl.errors import EpisodeError
from rallyrl.run.logs import read_jsonl
from tests.helpers.envs import Echo
from tests.helpers.runs import base_config, killed_run_copy

pytestmark = pytest.mark.smoke


def _cfg(model, run_dir, **sections):
    kw = {"rollout": {"num_rollouts": 4, "chunk_size": 4, "samples_per_prompt": 2},
          "generation": {"max_new_tokens": 5}, "ppo": {"estimator": "grpo", "init_kl_coef": 0.0, "epochs": 1},
          "reward": {"fn": "tests.helpers.envs:episode_reward"}, "env": {"kwargs": {"turns": 2}}}
    for k, v in sections.items():
        kw[k] = {**kw.get(k, {}), **v}
    return base_config(model, run_dir, **kw)


def test_grpo_over_two_turn_episodes(tiny_chat, tmp_path):
    run = tmp_path / "grpo"
    rallyrl.train(_cfg(tiny_chat, run, env={"turn_rewards": "per_turn"},
                       data={"eval_prompts": ["the cat", "a dog"]}, eval={"metric_fn": "tests.helpers.envs:episode_metric"}),
                  env=Echo)
    rows = read_jsonl(run / "rollouts.jsonl")
    assert len(rows) == 8 and all(len(r["episode"]["turns"]) == 2 for r in rows)
    for r in rows:
        turns = r["episode"]["turns"]
        assert r["output"] == "\n".join(t["text"] for t in turns)
        assert turns[0]["env_messages"][0]["content"].startswith("you said") and turns[0]["env_tokens"] > 0
        assert turns[1]["env_tokens"] == 0 and not r["episode"]["truncated"]
    m = read_jsonl(run / "metrics.jsonl")
    for x in [x for x in m if x["step"] > 0]:
        assert x["episode/turns"] == 2 and x["episode/tool_calls"] == 0 and x["episode/truncated"] == 0
        assert 0 < x["episode/env_token_fraction"] < 1 and x["episode/forks"] == 0
        step_rows = [r for r in rows if r["step"] == x["step"]]
        # the score is the reward function's plus the environment's per-turn rewards
        env = [sum(t["reward"] for t in r["episode"]["turns"]) for r in step_rows]
        assert x["episode/env_reward"] == pytest.approx(sum(env) / 4)
        assert x["reward/mean"] == pytest.approx(sum(r["reward"] for r in step_rows) / 4, rel=1e-6)
    ev = [x for x in m if "eval/turns" in x]
    assert ev and ev[-1]["eval/turns"] == 2 and ev[-1]["eval/turns_seen"] == 2
    first = read_jsonl(run / "eval" / "step_0.jsonl")
    assert len(first[0]["episode"]["turns"]) == 2


def test_ppo_over_episodes_from_yaml_with_a_budget_and_exact_resume(tiny_chat, tmp_path):
    cfg = lambda run, **train: _cfg(  # noqa: E731
        tiny_chat, run, rollout={"max_episode_tokens": 40, "samples_per_prompt": 1},
        ppo={"estimator": "gae", "init_kl_coef": 0.05}, env={"factory": "tests/helpers/envs.py:Echo",
                                                           "kwargs": {"turns": 4}, "max_turns": 3},
        train={"iterations": 3, **train}, checkpoint={"interval": 1, "keep_last": 3})
    full = tmp_path / "full"
    rallyrl.train(cfg(full))
    rows = read_jsonl(full / "rollouts.jsonl")
    assert all(r["episode"]["truncated"] for r in rows)  # 4 turns wanted, 3 allowed (or the 40-token budget)
    assert {len(r["episode"]["turns"]) for r in rows} <= {1, 2, 3}
    m = read_jsonl(full / "metrics.jsonl")
    assert all(x["episode/truncated"] == 1 and "value/mean" in x and "policy/kl" in x for x in m)
    # killed after checkpoint 2, resumed: the same run, bit for bit (the environment draws from the
    # global RNG and is isolated; every episode of an iteration is re-run from its prompts)
    resumed = killed_run_copy(full, tmp_path / "resumed", step=2)
    rallyrl.train(cfg(resumed, resume="latest"))
    a, b = (load_file(d / "final" / "model.safetensors") for d in (full, resumed))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert read_jsonl(full / "rollouts.jsonl") == read_jsonl(resumed / "rollouts.jsonl")


def test_an_environment_failure_stops_the_run_naming_prompt_and_turn(tiny_chat, tmp_path):
    class Broken(Echo):
        def step(self, message):
            raise KeyError("no such square")

    with pytest.raises(EpisodeError, match=r"prompt \d+, turn 1 \(Broken\): KeyError: 'no such square'"):
        rallyrl.train(_cfg(tiny_chat, tmp_path / "broken"), env=Broken)


def test_an_environment_needs_a_chat_template_and_a_factory(tiny_model, tiny_chat, tmp_path):
    with pytest.raises(rallyrl.ConfigError, match="env: multi-turn episodes .* need a tokenizer with a chat template"):
        rallyrl.train(_cfg(tiny_model, tmp_path / "nochat"), env=Echo)
    with pytest.raises(rallyrl.ConfigError, match="not an instance of Echo"):
        rallyrl.train(_cfg(tiny_chat, tmp_path / "inst"), env=Echo())
    with pytest.raises(rallyrl.ConfigError, match="rollout.max_episode_tokens is the budget of multi-turn episodes"):
        rallyrl.train(base_config(tiny_chat, tmp_path / "single", rollout={"max_episode_tokens": 64}))
    # train(env=...) is not in the config: the single-turn options are refused at start, before any model loads
    dyn = base_config(tiny_chat, tmp_path / "dyn", ppo={"estimator": "grpo"},
                      rollout={"samples_per_prompt": 2, "num_rollouts": 4, "dynamic_sampling": True})
    with pytest.raises(rallyrl.ConfigError, match=r"rollout\.dynamic_sampling work on single-turn samples only"):
        rallyrl.train(dyn, env=Echo)


def test_episodes_scored_by_a_local_reward_server_with_overlap_are_the_same_run(tiny_chat, tmp_path):
    """The transcript travels to a reward server as JSON metadata; scoring in the background while the next
    round's episodes run (reward.overlap) changes nothing."""
    pytest.importorskip("fastapi")
    env = {"factory": "tests.helpers.envs:Echo", "kwargs": {"turns": 2}}
    rallyrl.train(_cfg(tiny_chat, tmp_path / "inproc", env=env, rollout={"chunk_size": 2}))
    rallyrl.train(_cfg(tiny_chat, tmp_path / "served", env=env, rollout={"chunk_size": 2},
                       reward={"server": "local", "overlap": True}))
    a, b = (load_file(tmp_path / d / "final" / "model.safetensors") for d in ("inproc", "served"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert read_jsonl(tmp_path / "inproc" / "rollouts.jsonl") == read_jsonl(tmp_path / "served" / "rollouts.jsonl")
