"""examples/calculator: the seeded problems, the calculator tool, the rewards by hand, the shipped prompt
files and config."""

import json
from pathlib import Path

import pytest

from examples.calculator import make_prompts, task
from rallyrl.config import load_config

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "calculator"


def test_problems_are_seeded_distinct_and_held_out():
    a = task.make_problems(100, seed=3)
    assert a == task.make_problems(100, seed=3) and a != task.make_problems(100, seed=4)
    assert len({p["question"] for p in a}) == 100
    for p in a:
        x, op, y = p["question"].removeprefix("What is ").removesuffix("?").split()
        assert p["answer"] == (int(x) * int(y) if op == "*" else int(x) + int(y))
    train, evals = task.train_and_eval(200, 50, seed=0)
    assert not {p["question"] for p in train} & {p["question"] for p in evals}


def test_calculator_tool_by_hand():
    assert task.calculator("12 * 34") == "408"
    assert task.calculator("(100 + 20) / 8") == "15"
    assert task.calculator("7 / 2") == "3.5"
    assert task.calculator("-3 - 4") == "-7"
    for bad in ("__import__('os')", "2 ** 8", "x + 1"):
        with pytest.raises(ValueError, match="only numbers"):
            task.calculator(bad)
    with pytest.raises(ValueError, match="too long"):
        task.calculator("1 + " * 30 + "1")


def test_rewards_and_metrics_by_hand():
    turns = [['<tool_call>{"name": "calculator", "arguments": {"expression": "19 * 43"}}'], "The answer is 817."]
    texts = [[turns[0][0], turns[1]],  # a call, then the right answer
             ["19 * 43 = 679."],  # a wrong answer without the tool
             [turns[0][0]],  # a call and no answer (cut by env.max_turns)
             ["It is 1,817 or 817"]]  # the last number counts (commas dropped)
    ok = {"name": "calculator", "error": None}
    calls = [[[ok], []], [[]], [[ok]], [[{"name": "math", "error": "there is no tool 'math'"}]]]
    assert task.correct_reward(None, None, None, answer=[817] * 4, turn_texts=texts) == [1.0, 0.0, 0.0, 1.0]
    assert task.tool_reward(None, None, None, tool_calls=calls) == [1.0, 0.0, 1.0, 0.0]
    m = task.metric_fn(None, None, None, answer=[817] * 4, turn_texts=texts, tool_calls=calls)
    assert m == {"correct": [1.0, 0.0, 0.0, 1.0], "used_tool": [1.0, 0.0, 1.0, 0.0], "answered": [1.0, 1.0, 0.0, 1.0]}


def test_shipped_prompt_files_are_the_generator_output(tmp_path):
    make_prompts.main(["--out-dir", str(tmp_path)])
    for name in ("prompts.jsonl", "eval_prompts.jsonl"):
        assert (tmp_path / name).read_text() == (EXAMPLE / name).read_text()
    first = json.loads((EXAMPLE / "prompts.jsonl").read_text().splitlines()[0])
    assert first["prompt"][1:5] == task.EXAMPLE and first["prompt"][-1]["content"] == first["question"]


def test_shipped_config_loads_with_its_environment(monkeypatch):
    monkeypatch.chdir(ROOT)  # the config's paths are relative to the repository root
    cfg = load_config(EXAMPLE / "grpo.yaml")
    assert cfg.env.factory == "rallyrl.rollout.env:ToolEnv" and cfg.generation.engine == "hf"
    assert [f.name for f in cfg.reward.fns] == ["correct", "tool"]


def test_shipped_config_passes_the_start_checks(monkeypatch, tiny_chat):
    """`rallyrl check` / the start of a run on the shipped config (on the tiny chat model): its reward and
    metric functions take the transcript (`turn_texts`, `tool_calls`), which multi-turn episodes pass, so
    the start-time argument check must count them; without an environment the same functions are refused
    there, naming the argument."""
    from rallyrl.config import ConfigError
    from rallyrl.inputs import prepare_inputs

    monkeypatch.chdir(ROOT)
    over = [f"model.path={tiny_chat}", "model.prepare=null", "data.long_prompts=truncate_left"]  # a tiny tokenizer
    inp = prepare_inputs(load_config(EXAMPLE / "grpo.yaml", over), world_size=2)
    assert inp.env is not None and [f.name for f in inp.reward_fns] == ["correct", "tool"]
    with pytest.raises(ConfigError, match="requires the argument 'turn_texts'"):
        prepare_inputs(load_config(EXAMPLE / "grpo.yaml", over + ["env.factory=null"]), world_size=2)


def test_a_data_column_named_like_a_transcript_argument_is_refused_at_start(monkeypatch, tiny_chat, tmp_path):
    from rallyrl.config import ConfigError
    from rallyrl.inputs import prepare_inputs

    monkeypatch.chdir(ROOT)
    rows = [json.loads(line) for line in (EXAMPLE / "prompts.jsonl").read_text().splitlines()[:4]]
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({**r, "turn_texts": "x"}) + "\n" for r in rows))
    cfg = load_config(EXAMPLE / "grpo.yaml", [f"model.path={tiny_chat}", "model.prepare=null", f"data.prompts={data}",
                                              "data.eval_prompts=null"])
    with pytest.raises(ConfigError, match="data column 'turn_texts' has the name of an argument multi-turn episodes"):
        prepare_inputs(cfg, world_size=2)
