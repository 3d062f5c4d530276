"""Real runs with a reward function written for TRL (keywords: prompts, completions, completion_ids, a data
column by name) that returns None for some samples, on a tiny chat model: GRPO (an unscorable sample gets
advantage 0 and stays out of its group's statistics; a group with no scorable sample gets 0) and PPO with
GAE (an unscorable sample is left out of the update). And `rallyrl check` / `train` refusing, before any
model loads or any worker starts, the signatures and columns that used to fail at the first reward call."""

from __future__ import annotations

import statistics
import subprocess
from pathlib import Path

import pytest
import yaml

import rallyrl
from rallyrl.cli import main
from rallyrl.run.logs import read_jsonl
from tests.helpers.rewards import trl_unscorable
from tests.helpers.runs import base_config

pytestmark = pytest.mark.smoke

# 4 conversational prompts; the last has no answer, so all of its samples are unscorable
ROWS = [{"prompt": [{"role": "user", "content": w}], "answer": a}
        for w, a in (("the cat", "a"), ("a dog", "o"), ("good morning", "g"), ("i like", None))]



def _run(model, run_dir, calls, **ppo):
    def reward(prompts, completions, completion_ids, answer, **kwargs):  # TRL's signature, recorded
        calls.append({"prompts": prompts, "completions": completions, "ids": completion_ids, "answer": answer,
                      "extra": sorted(kwargs)})
        return trl_unscorable(prompts, completions, completion_ids, answer, **kwargs)

    cfg = base_config(model, run_dir, rollout={"num_rollouts": 12, "chunk_size": 6, "samples_per_prompt": 4},
                      ppo={"epochs": 1, "num_minibatches": 1, "lr": 1e-3, **ppo}, generation={"max_new_tokens": 5})
    return rallyrl.train(cfg, reward_fn=reward, prompts=ROWS)


def test_grpo_with_a_trl_function_and_unscorable_samples(chat_model, tmp_path):
    calls: list[dict] = []
    _run(chat_model, tmp_path / "grpo", calls, estimator="grpo", kl_in="loss", init_kl_coef=0.05)
    # called the TRL way: the prompts' messages, each completion as one assistant message, its ids
    assert calls and all(c["extra"] == [] for c in calls)  # nothing but TRL's names and the data column
    by_content = {r["prompt"][0]["content"]: r for r in ROWS}
    for c in calls:
        for p, comp, ids, ans in zip(c["prompts"], c["completions"], c["ids"], c["answer"]):
            assert p == by_content[p[0]["content"]]["prompt"] and ans == by_content[p[0]["content"]]["answer"]
            assert comp == [{"role": "assistant", "content": comp[0]["content"]}]
            assert all(isinstance(t, int) for t in ids)
    rows = read_jsonl(tmp_path / "grpo" / "rollouts.jsonl")
    metrics = {m["step"]: m for m in read_jsonl(tmp_path / "grpo" / "metrics.jsonl")}
    unscorable = [r for r in rows if r["reward"] is None]
    assert unscorable and len(unscorable) < len(rows)
    assert all(r["advantage"] == 0.0 for r in unscorable)
    assert any(all(r["reward"] is None for r in rows if (r["step"], r["group"]) == (u["step"], u["group"]))
               for u in unscorable)  # the prompt without an answer: a group with no scorable sample
    checked = 0
    for step in (1, 2):
        mine = [r for r in rows if r["step"] == step]
        scored = [r["reward"] for r in mine if r["reward"] is not None]
        assert metrics[step]["reward/unscorable"] == len(mine) - len(scored)
        assert metrics[step]["reward/mean"] == pytest.approx(statistics.mean(scored))
        for g in {r["group"] for r in mine}:  # GRPO over each group's scorable members only
            members = [r for r in mine if r["group"] == g and r["reward"] is not None]
            if len(members) > 1 and statistics.stdev(r["reward"] for r in members) > 0:
                values = [r["reward"] for r in members]
                mean, std = statistics.mean(values), statistics.stdev(values)
                for r in members:
                    assert r["advantage"] == pytest.approx((r["reward"] - mean) / std, rel=1e-4, abs=1e-5)
                checked += 1
            elif len(members) == 1:  # one scorable member: no baseline
                assert members[0]["advantage"] == 0.0
    assert checked >= 2


def test_gae_leaves_unscorable_samples_out_of_the_update(chat_model, tmp_path):
    calls: list[dict] = []
    result = _run(chat_model, tmp_path / "gae", calls)
    rows = read_jsonl(tmp_path / "gae" / "rollouts.jsonl")
    assert result.iterations == 2 and any(r["reward"] is None for r in rows)
    assert all(r["advantage"] == 0.0 for r in rows if r["reward"] is None)
    counted = sum(m["reward/unscorable"] for m in read_jsonl(tmp_path / "gae" / "metrics.jsonl"))
    assert counted == sum(r["reward"] is None for r in rows)


# ---- refused at start: `train`, `check` and the 2-process launcher, each before any model or worker


def _cfg(tmp: Path, model: Path, prompts: list, reward: dict) -> dict:
    return {"model": {"path": str(model)}, "data": {"prompts": prompts},
            "train": {"run_dir": str(tmp / "run"), "iterations": 1, "num_threads": 1, "progress": False},
            "rollout": {"num_rollouts": 2, "chunk_size": 2}, "generation": {"max_new_tokens": 4}, "reward": reward}


HELPERS = "tests.helpers.rewards:"
TESTS = "tests.unit.test_reward_signature:"
PAIRS = [{"prompt": "2+3=", "answer": "5"}, {"prompt": "1+1=", "answer": "2"}]
CASES = {
    "column-outputs": ([{"prompt": "2+3=", "outputs": "5"}, {"prompt": "1+1=", "outputs": "2"}],
                       {"fn": HELPERS + "hashed"},
                       "data.prompts: data column 'outputs' has the name of an argument rallyrl passes to reward "
                       "function 'hashed' (trlx signature"),
    "column-tokenizer": ([{"prompt": "2+3=", "tokenizer": "x"}, {"prompt": "1+1=", "tokenizer": "y"}],
                         {"fn": HELPERS + "hashed"}, "data column 'tokenizer' has the name of an argument"),
    "answer-forced-trlx": (PAIRS, {"fn": TESTS + "answer_reward", "signature": "trlx"},
                           "'answer_reward' is called with the trlx signature, fn(samples, prompts, outputs, "
                           "**kwargs), but takes 2 positional parameter(s) (completions, answer); add the missing "
                           "ones (or *args), or, if it is written for TRL, set reward.signature: trl"),
    "missing-column": ([{"prompt": "2+3="}, {"prompt": "1+1="}], {"fn": TESTS + "answer_reward"},
                       "requires the argument 'answer'"),
    "impossible": (PAIRS, {"fn": HELPERS + "_text"}, "reward function '_text' is called with the trlx signature, "
                                                      "fn(samples, prompts, outputs, **kwargs), but takes 1"),
    "ambiguous": (PAIRS, {"fn": TESTS + "ambiguous"}, "reward function 'ambiguous' has parameters of both "
                                                      "signatures"),
}


@pytest.fixture
def no_workers(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("a worker was started before the bad input was found")

    monkeypatch.setattr(subprocess, "Popen", boom)


@pytest.mark.parametrize("case", list(CASES))
def test_refused_at_start_with_the_fix(case, tmp_path, tiny_model, capsys, no_workers):
    prompts, reward, needle = CASES[case]
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(_cfg(tmp_path, tiny_model, prompts, reward)))
    for argv in (["check", str(path)], ["train", str(path)], ["train", str(path), "--nproc", "2"]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("rallyrl: error: ") and err.count("\n") == 1 and needle in err, (argv, err)
    assert not (tmp_path / "run").exists()


def test_check_accepts_the_trl_function_and_says_how_it_is_called(tmp_path, tiny_model, capsys):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(_cfg(tmp_path, tiny_model, PAIRS, {"fn": TESTS + "answer_reward"})))
    assert main(["check", str(path)]) == 0, capsys.readouterr().err
    assert "called as answer_reward: trl (reward.signature: auto)" in capsys.readouterr().out
