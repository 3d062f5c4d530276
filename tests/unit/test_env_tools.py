"""Tools (rallyrl/rollout/env): JSON schemas from signatures, the tool-call parsers, ToolEnv's handling
of the model's mistakes, and the runner's limits (concurrency, timeouts, sync and async tools, error policy)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Literal

import pytest

from rallyrl.rollout.env import (EnvRunner, EnvTimeout, Step, ToolEnv, ToolFailure, as_step, env_factory,
                                 parse_hermes, parse_llama3_json, tool_schema)


def add(a: int, b: int = 0) -> int:
    """Add two integers.

    Args:
        a: the first number
        b: the second number, which
            may be omitted
    """
    return a + b


async def lookup(key: str, unit: Literal["m", "km"] | None = None, tags: list[str] | None = None) -> str:
    """Look something up."""
    return key


def test_tool_schema_from_signature_and_docstring():
    assert tool_schema(add) == {"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {
            "a": {"type": "integer", "description": "the first number"},
            "b": {"type": "integer", "description": "the second number, which may be omitted"}},
            "required": ["a"]}}}
    assert tool_schema(lookup)["function"]["parameters"] == {"type": "object", "properties": {
        "key": {"type": "string"},
        "unit": {"anyOf": [{"type": "string", "enum": ["m", "km"]}, {"type": "null"}]},
        "tags": {"anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "null"}]}},
        "required": ["key"]}

    def bare(x, *rest):
        pass

    with pytest.raises(TypeError, match=r"\*args / \*\*kwargs"):
        tool_schema(bare)

    def undocumented(x: float | None = None):
        pass

    assert tool_schema(undocumented) == {"type": "function", "function": {"name": "undocumented", "parameters": {
        "type": "object", "properties": {"x": {"type": ["number", "null"]}}}}}


def test_hermes_parser():
    text = ('I will add.<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
            '<tool_call>{"name": "lookup", "arguments": "{\\"key\\": \\"x\\"}"}</tool_call>')
    calls = parse_hermes(text)
    assert [(c.name, c.arguments, c.error) for c in calls] == [("add", {"a": 2, "b": 3}, None),
                                                              ("lookup", {"key": "x"}, None)]
    assert parse_hermes("The answer is 5.") == []
    bad = parse_hermes('<tool_call>{"name": "add", "arguments": {"a": 2,}}</tool_call><tool_call>{"name": "a')
    assert "not valid JSON" in bad[0].error and "not closed" in bad[1].error
    assert "string \"name\"" in parse_hermes('<tool_call>[1, 2]</tool_call>')[0].error
    assert "must be a JSON object" in parse_hermes('<tool_call>{"name": "add", "arguments": 3}</tool_call>')[0].error


def test_llama3_json_parser():
    assert [(c.name, c.arguments) for c in parse_llama3_json(' {"name": "add", "parameters": {"a": 1}} ')] == \
        [("add", {"a": 1})]
    assert len(parse_llama3_json('[{"name": "add", "arguments": {}}, {"name": "lookup", "arguments": {}}]')) == 2
    assert parse_llama3_json("5") == [] and parse_llama3_json('{"answer": 5}') == [] and parse_llama3_json("{oops") == []


def _step(env, text, runner=None):
    runner = runner or EnvRunner(5.0, 4)
    try:
        [(out, err)] = runner.run([lambda: env.step({"role": "assistant", "content": text})])
    finally:
        runner.close()
    assert err is None, err
    return out


def test_tool_env_runs_calls_and_tells_the_model_its_mistakes():
    env = ToolEnv([add, lookup])
    done = _step(env, "It is 5.")
    assert done.done and done.messages == []
    out = _step(env, '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
                     '<tool_call>{"name": "lookup", "arguments": {"key": "k"}}</tool_call>'
                     '<tool_call>{"name": "mul", "arguments": {}}</tool_call>'
                     '<tool_call>{"name": "add", "arguments": {"c": 1}}</tool_call>')
    assert not out.done
    assert out.messages == [{"role": "tool", "name": "add", "content": "5"},
                            {"role": "tool", "name": "lookup", "content": "k"},
                            {"role": "tool", "name": "mul", "content": "Error: there is no tool 'mul'; the tools are add, lookup"},
                            {"role": "tool", "name": "add", "content": out.messages[3]["content"]}]
    assert out.messages[3]["content"].startswith("Error: bad arguments for 'add'")
    assert [c.error is None for c in out.tool_calls] == [True, True, False, False]


def test_tool_errors_are_messages_or_stop_the_run():
    def boom(x: int) -> int:
        raise ZeroDivisionError("division by zero")

    env = ToolEnv([boom])
    call = '<tool_call>{"name": "boom", "arguments": {"x": 1}}</tool_call>'
    out = _step(env, call)
    assert out.messages[0]["content"] == "Error: ZeroDivisionError: division by zero" and out.tool_calls[0].error
    runner = EnvRunner(5.0, 4, on_error="fail")
    try:
        [(_, err)] = runner.run([lambda: env.step({"role": "assistant", "content": call})])
    finally:
        runner.close()
    assert isinstance(err, ToolFailure) and err.tool == "boom" and "division by zero" in str(err)


def test_a_slow_or_hung_tool_times_out_without_holding_the_others():
    release = threading.Event()

    def hang(x: int) -> int:
        release.wait(30)
        return x

    async def slow(x: int) -> int:
        await asyncio.sleep(30)
        return x

    env = ToolEnv([hang, slow, add])
    t0 = time.perf_counter()
    out = _step(env, '<tool_call>{"name": "hang", "arguments": {"x": 1}}</tool_call>'
                     '<tool_call>{"name": "slow", "arguments": {"x": 1}}</tool_call>'
                     '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>', EnvRunner(0.3, 4))
    release.set()
    assert time.perf_counter() - t0 < 10
    assert [m["content"] for m in out.messages] == [
        "Error: tool 'hang' did not return within env.tool_timeout_s=0.3 s",
        "Error: tool 'slow' did not return within env.tool_timeout_s=0.3 s", "1"]


def test_concurrency_limit_and_sync_tools_run_beside_each_other():
    lock, running, peak = threading.Lock(), [0], [0]
    both = threading.Barrier(2, timeout=10)

    def work(x: int) -> int:
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.05)
        with lock:
            running[0] -= 1
        return x

    def meet(x: int) -> int:  # returns only if another call runs at the same time (never serialised)
        both.wait()
        return x

    calls = "".join(f'<tool_call>{{"name": "work", "arguments": {{"x": {i}}}}}</tool_call>' for i in range(6))
    out = _step(ToolEnv([work]), calls, EnvRunner(10.0, 2))
    assert [m["content"] for m in out.messages] == [str(i) for i in range(6)] and peak[0] == 2
    pair = '<tool_call>{"name": "meet", "arguments": {"x": 1}}</tool_call>' * 2
    assert [m["content"] for m in _step(ToolEnv([meet]), pair, EnvRunner(10.0, 2)).messages] == ["1", "1"]


def test_a_blocking_async_tool_is_a_clear_error_not_a_hang():
    async def blocks(x: int) -> int:
        time.sleep(1.0)  # blocks the event loop: nothing else on it can run
        return x

    runner = EnvRunner(0.2, 4, turn_timeout_s=0.3)
    env = ToolEnv([blocks])
    with pytest.raises(EnvTimeout, match="blocks the event loop"):
        runner.run([lambda: env.step({"role": "assistant", "content":
                                      '<tool_call>{"name": "blocks", "arguments": {"x": 1}}</tool_call>'})])
    runner.close()


def test_steps_are_checked_and_factories_not_instances():
    assert as_step(([{"role": "user", "content": "again"}], False, 1), "env").reward == 1
    with pytest.raises(TypeError, match="done must be a bool"):
        as_step(([], "yes"), "env")
    with pytest.raises(TypeError, match="finite number"):
        as_step(Step([], True, float("nan")), "env")
    with pytest.raises(TypeError, match="message 0 must be a dict"):
        as_step(([{"role": "user"}], False), "env")
    with pytest.raises(TypeError, match="not an instance of ToolEnv"):
        env_factory(ToolEnv([add]))
    assert isinstance(env_factory(ToolEnv, {"tools": [add]})(), ToolEnv)
    with pytest.raises(TypeError, match="has no reset"):
        env_factory(lambda: 3)()


def test_env_config_keys_are_checked():
    from rallyrl.config import ConfigError, load_config

    cfg = load_config({"env": {"factory": "rallyrl.rollout.env:ToolEnv", "kwargs": {"tools": []}, "max_turns": 3,
                               "turn_rewards": "per_turn", "on_template_drift": "fork"},
                       "rollout": {"max_episode_tokens": 512}})
    assert cfg.env.max_turns == 3 and cfg.rollout.max_episode_tokens == 512
    for bad, key in [({"env": {"max_turns": 0}}, "env.max_turns"), ({"env": {"tool_timeout_s": 0}}, "env.tool_timeout_s"),
                     ({"env": {"on_tool_error": "ignore"}}, "env.on_tool_error"),
                     ({"rollout": {"max_episode_tokens": 0}}, "rollout.max_episode_tokens"),
                     ({"env": {"max_concurrent_tools": 0}}, "env.max_concurrent_tools")]:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(bad)
    with pytest.raises(ConfigError, match="fork with model.sharding: fsdp"):
        load_config({"env": {"on_template_drift": "fork"}, "model": {"sharding": "fsdp"}, "ppo": {"micro_batch_size": 2}})


def test_multi_turn_episodes_load_with_either_engine_and_refuse_single_turn_options():
    """env.factory loads with generation.engine hf and vllm (the turns are engine calls, token ids in and
    out); the options defined for single-turn samples are still refused when the config loads."""
    from rallyrl.config import ConfigError, load_config

    env = {"factory": "rallyrl.rollout.env:ToolEnv", "kwargs": {"tools": []}}
    grpo = {"ppo": {"estimator": "grpo"}, "rollout": {"samples_per_prompt": 2, "num_rollouts": 4}}
    assert load_config({"env": env}).generation.engine == "hf"
    assert load_config({"env": env, "generation": {"engine": "vllm"}, **grpo}).generation.engine == "vllm"
    with pytest.raises(ConfigError, match=r"rollout\.dynamic_sampling work on single-turn samples only"):
        load_config({"env": env, "generation": {"engine": "vllm"}, "ppo": {"estimator": "grpo"},
                     "rollout": {"samples_per_prompt": 2, "num_rollouts": 4, "dynamic_sampling": True}})


def test_a_column_named_like_a_transcript_keyword_is_named_in_one_message():
    """The start-time check (inputs.py) and the per-episode ones (rollout/episode.py) use one message."""
    from rallyrl.rollout.episode import reward_metadata, transcript_clash

    assert transcript_clash(["question", "answer"], "data.prompts") is None
    assert transcript_clash(["truncated", "messages"], "data.prompts").startswith(
        "data.prompts: data column 'messages' has the name of an argument multi-turn episodes give")
    t = {"messages": [], "turns": [], "env_rewards": [], "truncated": False}
    with pytest.raises(ValueError, match="the prompts: data column 'tool_calls'"):
        reward_metadata([{"tool_calls": 1}], [t])
