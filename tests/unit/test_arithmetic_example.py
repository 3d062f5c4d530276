"""examples/arithmetic: the seeded problem generator, the rewards, the shipped configs and prompt files."""

import json
from pathlib import Path

import pytest

from examples.arithmetic import task
from rallyrl.config import load_config, make_batch_plan
from rallyrl.data import load_prompts
from rallyrl.reward.loading import load_callable

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "arithmetic"


@pytest.fixture(autouse=True)
def from_repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # the configs' paths are relative to the repository root


def test_generator_is_seeded_distinct_and_correct():
    a = task.make_problems(200, seed=3)
    assert a == task.make_problems(200, seed=3)
    assert a != task.make_problems(200, seed=4)
    assert len({p["question"] for p in a}) == 200
    for p in a:
        assert 0 <= p["a"] <= 9 and 0 <= p["b"] <= 9 and (p["b"] >= 1 or p["op"] == "-")
        assert p["answer"] == (p["a"] + p["b"] if p["op"] == "+" else p["a"] - p["b"]) >= 0
        assert str(p["a"]) in p["question"] and str(p["b"]) in p["question"]


def test_train_and_eval_sets_share_no_question():
    train, evals = task.train_and_eval(300, 50, seed=0)
    assert len(train) == 300 and len(evals) == 50
    assert not {p["question"] for p in train} & {p["question"] for p in evals}


def test_generator_refuses_more_problems_than_exist():
    with pytest.raises(ValueError, match="distinct"):
        task.make_problems(10_000, seed=0, max_operand=1, ops=("+",))


def test_final_number_and_rewards_by_hand():
    assert task.final_number("Mia has 3 + 4 = 7 apples.") == 7
    assert task.final_number("no digits") is None
    outs = ["7", " 7.\n", "The answer is 7", "3 + 4 = 8", "", "70"]
    assert task.correct_reward(None, None, outs, answer=[7] * 6) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert task.format_reward(None, None, outs) == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    assert task.reward_fn(None, None, ["7", "It is 7", "8"], answer=[7, 7, 7]) == [1.1, 1.0, 0.1]
    m = task.metric_fn(None, None, ["7", "8"], answer=[7, 7])
    assert m == {"correct": [1.0, 0.0], "format": [1.0, 1.0]}


def test_shipped_prompt_files_are_the_generator_output():
    from examples.arithmetic import make_prompts

    train = [json.loads(line) for line in (EXAMPLE / "prompts.jsonl").read_text().splitlines()]
    evals = [json.loads(line) for line in (EXAMPLE / "eval_prompts.jsonl").read_text().splitlines()]
    gen_train, gen_eval = task.train_and_eval(len(train), len(evals), 0)
    assert train == make_prompts.rows(gen_train) and evals == make_prompts.rows(gen_eval)
    # conversational prompts: a short system message, then the question and the instruction
    assert [m["role"] for m in train[0]["prompt"]] == ["system", "user"]
    assert train[0]["prompt"][1]["content"] == f"{train[0]['question']} {task.INSTRUCTION}"


@pytest.mark.parametrize("name", ["grpo.yaml", "rloo.yaml"])
def test_configs_load_and_name_what_exists(name):
    cfg = load_config(EXAMPLE / name)
    plan = make_batch_plan(cfg, 2)
    assert cfg.ppo.estimator in ("grpo", "rloo") and cfg.rollout.samples_per_prompt >= 2
    assert plan.num_rollouts % cfg.rollout.samples_per_prompt == 0
    for spec in [f.fn for f in cfg.reward.fns] + [cfg.eval.metric_fn, cfg.model.prepare]:
        assert callable(load_callable(spec, "test"))
    assert len(load_prompts(cfg.data.prompts)) == 512 and len(load_prompts(cfg.data.eval_prompts)) == 100
    if cfg.ppo.estimator == "grpo":
        assert cfg.ppo.init_kl_coef == 0 and not cfg.ppo.uses_reference
    else:
        assert cfg.ppo.init_kl_coef > 0
