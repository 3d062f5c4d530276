"""`env:`: multi-turn episodes (an environment and its tools; docs/environments.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from .fields import _f


@dataclass
class EnvConfig:
    factory: str | None = _f(
        None,
        "Import path (`module:attr` or `file.py:attr`) of the environment of multi-turn episodes: a class (or a "
        "function) called as `factory(**env.kwargs)` once per episode, whose objects have `reset(record)` and "
        "`step(message)` (docs/environments.md); e.g. `rallyrl.rollout.env:ToolEnv` with `kwargs: {tools: "
        "[...]}`. null = single-turn episodes (one response per prompt). `rallyrl.train(env=...)` overrides it.",
    )
    kwargs: dict[str, Any] = _f({}, "Keyword arguments of `env.factory` (each episode's environment is built with them).")
    max_turns: int = _f(
        4, "Most assistant turns per episode; an episode the environment would continue after it is truncated.", gt=0
    )
    tool_timeout_s: float = _f(
        30.0,
        "Seconds a tool call may take (and a `reset`/`step` of an environment that is not a `ToolEnv`); a call "
        "that overruns is abandoned and handled by `env.on_tool_error`.",
        gt=0,
    )
    max_concurrent_tools: int = _f(8, "Tool calls that may run at once in one process (the others queue).", gt=0)
    on_tool_error: Literal["message", "fail"] = _f(
        "message",
        "A tool that raises or times out: `message` (the model is told `Error: ...` in the tool's result and the "
        "episode goes on; counted in `episode/tool_errors`) or `fail` (every rank stops with an EpisodeError "
        "naming the tool, the prompt and the turn). A call the model got wrong (unknown tool, bad arguments, "
        "unparsable) is always a message.",
    )
    turn_rewards: Literal["sum", "per_turn"] = _f(
        "sum",
        "Where the environment's own rewards (`step`'s reward) go: `sum` (added to the episode's score) or "
        "`per_turn` (each on its turn's last sampled token, so `gae` credits each turn; the critic-free "
        "estimators see their sum either way).",
    )
    on_template_drift: Literal["fail", "fork"] = _f(
        "fail",
        "When the chat template is not prefix-preserving at a step (it rewrites earlier turns, e.g. drops "
        "`<think>` blocks): `fail` (every rank stops, naming the prompt and the turn) or `fork` (the episode "
        "goes on in a new training row whose query is the re-rendered conversation; `episode/forks`).",
    )
