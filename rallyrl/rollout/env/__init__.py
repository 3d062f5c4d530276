"""Environments for multi-turn episodes: the protocol, ``ToolEnv`` and its tools and parsers, the runner
that executes environment calls and tools, and the chat-template delta that turns the environment's
messages into tokens (docs/environments.md).

- ``protocol.py``: ``Environment`` (``reset(record)`` / ``step(message)``), ``Step``, ``env_factory``.
- ``tools.py``: ``tool_schema`` (JSON schema from a signature and docstring), the ``hermes`` and
  ``llama3_json`` parsers, ``ToolEnv``.
- ``runner.py``: ``EnvRunner`` (one event loop per process; timeouts, a concurrency limit, error policy)
  and ``call_tool``.
- ``template.py``: ``ChatRenderer`` (render, closing of a turn, delta with the prefix check).

The episode loop that drives engine and environment is ``rallyrl/rollout/episode.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .protocol import EnvFactory, Environment, Step, ToolCallRecord, as_step, env_factory
from .runner import EnvRunner, EnvTimeout, ToolFailure, call_tool
from .template import ChatRenderer, TemplateDrift, TemplateError
from .tools import PARSERS, ToolCall, ToolEnv, parse_hermes, parse_llama3_json, tool_schema

TURN_REWARDS = ("sum", "per_turn")
ON_TEMPLATE_DRIFT = ("fail", "fork")


@dataclass
class EnvSetup:
    """Everything the episode loop needs about the environment (built once per run from ``env.*``)."""

    factory: EnvFactory
    runner: EnvRunner
    max_turns: int = 4
    max_tokens: int | None = None  # the context budget of a training row (prompt + turns); None = unbounded
    turn_rewards: str = "sum"
    on_template_drift: str = "fail"

    def __post_init__(self) -> None:
        if self.turn_rewards not in TURN_REWARDS:
            raise ValueError(f"env.turn_rewards must be one of {TURN_REWARDS}, got {self.turn_rewards!r}")
        if self.on_template_drift not in ON_TEMPLATE_DRIFT:
            raise ValueError(f"env.on_template_drift must be one of {ON_TEMPLATE_DRIFT}, got {self.on_template_drift!r}")
        if self.max_turns < 1:
            raise ValueError(f"env.max_turns must be >= 1, got {self.max_turns}")

    def close(self) -> None:
        self.runner.close()


def env_setup(env: Any, kwargs: dict[str, Any], max_turns: int, tool_timeout_s: float, max_concurrent_tools: int,
              on_tool_error: str, turn_rewards: str, on_template_drift: str, max_tokens: int | None,
              turn_timeout_s: float | None) -> EnvSetup:
    """An ``EnvSetup`` from the ``env.*`` settings (``env``: a factory or an import path)."""
    runner = EnvRunner(tool_timeout_s, max_concurrent_tools, on_tool_error, turn_timeout_s)
    return EnvSetup(env_factory(env, kwargs), runner, max_turns, max_tokens, turn_rewards, on_template_drift)


__all__ = ["ChatRenderer", "EnvFactory", "EnvRunner", "EnvSetup", "EnvTimeout", "Environment", "PARSERS", "Step",
           "TemplateDrift", "TemplateError", "ToolCall", "ToolCallRecord", "ToolEnv", "ToolFailure", "as_step",
           "call_tool", "env_factory", "env_setup", "parse_hermes", "parse_llama3_json", "tool_schema"]
