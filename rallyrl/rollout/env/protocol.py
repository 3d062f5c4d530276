"""The environment protocol: what a multi-turn episode asks of the world the policy acts in.

An environment is a small object, one per episode (``env.factory`` is called once per episode, so no
state leaks between episodes, nor between the G members of a group):

- ``reset(record) -> messages | None``: the episode starts from the prompt record (``{"prompt": str or
  messages, ...metadata columns}``); the messages returned (e.g. an observation) are appended to the
  prompt's conversation before the first assistant turn. ``None``: nothing to add.
- ``step(message) -> Step | (messages, done, reward)``: the assistant's turn (``{"role": "assistant",
  "content": text}``, the decoding of exactly the sampled ids) in; the environment's reply out: new
  messages (``tool``, ``user``, ...), whether the episode is done, and an optional reward for this turn.
- ``tools`` (optional attribute): plain Python functions whose signatures and docstrings become the JSON
  schemas the chat template renders (``apply_chat_template(..., tools=...)``, the transformers
  convention).

``reset`` and ``step`` may be ``async def``. Sync ones run on a worker thread, async ones on the
episode runner's event loop (``runner.py``), so one environment never holds up another's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Environment(Protocol):
    """What ``env.factory`` must build (see the module docstring)."""

    def reset(self, record: dict[str, Any]) -> Any:
        ...

    def step(self, message: dict[str, Any]) -> Any:
        ...


@dataclass
class ToolCallRecord:
    """One tool call of an assistant turn as the environment ran it (for the transcript and metrics)."""

    name: str
    arguments: Any  # the parsed arguments (a dict), or the raw text when they did not parse
    result: str  # what the model was shown (the tool's output, or the error message)
    error: str | None = None  # why the call failed (unknown tool, bad arguments, raised, timed out); None = ok

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "arguments": self.arguments, "result": self.result, "error": self.error}


@dataclass
class Step:
    """An environment's reply to one assistant turn."""

    messages: list[dict[str, Any]] = field(default_factory=list)  # appended to the conversation
    done: bool = False  # the episode ends after this turn
    reward: float | None = None  # this turn's reward from the environment (env.turn_rewards says where it goes)
    tool_calls: list[ToolCallRecord] = field(default_factory=list)  # what ToolEnv ran (for transcripts)


def as_step(out: Any, where: str) -> Step:
    """A ``step`` return value as a checked ``Step``: a ``Step``, or a tuple ``(messages, done)`` /
    ``(messages, done, reward)``. ``where`` names the environment and turn in errors."""
    if isinstance(out, Step):
        step = out
    elif isinstance(out, tuple) and len(out) in (2, 3):
        step = Step(list(out[0]) if out[0] is not None else [], out[1], out[2] if len(out) == 3 else None)
    else:
        raise TypeError(f"{where}: step() must return a Step or a tuple (messages, done[, reward]), "
                        f"got {type(out).__name__}")
    if not isinstance(step.done, bool):
        raise TypeError(f"{where}: step()'s done must be a bool, got {type(step.done).__name__}")
    r = step.reward
    if r is not None and (isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r)):
        raise TypeError(f"{where}: step()'s reward must be a finite number or None, got {r!r}")
    step.messages = check_messages(step.messages, where, "step()")
    return step


def check_messages(messages: Any, where: str, what: str) -> list[dict[str, Any]]:
    """Messages an environment returned: a list of ``{"role": str, "content": str, ...}``."""
    if messages is None:
        return []
    if not isinstance(messages, list):
        raise TypeError(f"{where}: {what} must return a list of messages, got {type(messages).__name__}")
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise TypeError(f"{where}: {what} message {j} must be a dict with a string 'role' and 'content', "
                            f"got {m!r}")
    return messages


EnvFactory = Callable[[], Any]


def env_factory(env: Any, kwargs: dict[str, Any] | None = None, what: str = "env.factory") -> EnvFactory:
    """``env`` (a class, a function returning a fresh environment, or an import path naming one) as a
    zero-argument factory that builds one environment per episode with ``kwargs``."""
    from ...reward.loading import load_object

    if isinstance(env, str):
        env = load_object(env, what)
    if not callable(env) or isinstance(env, Environment) and not isinstance(env, type):
        kind = type(env).__name__
        raise TypeError(f"{what}: pass a factory (a class, or a function that returns a fresh environment "
                        f"for each episode), not {'an instance of ' + kind if isinstance(env, Environment) else kind}:"
                        f" environments keep per-episode state")
    kw = dict(kwargs or {})

    def build() -> Any:
        obj = env(**kw)
        if not isinstance(obj, Environment):
            raise TypeError(f"{what}: {getattr(env, '__name__', env)!r}(**env.kwargs) returned a "
                            f"{type(obj).__name__}, which has no reset(record) and step(message)")
        return obj

    build.__name__ = getattr(env, "__name__", "env")
    return build
