"""Environments and tools used by the tests (importable as `tests.helpers.envs:NAME` or by file path):
USER code as far as rallyrl is concerned."""

from __future__ import annotations

import os
import random

from rallyrl.rollout.env import ToolEnv
from tests.helpers.rewards import deterministic_score


class Echo:
    """Answers every assistant turn with a user message about it; done after ``turns`` turns. Its reward
    for a turn depends on exactly what was said (a deterministic environment). It draws from the global
    RNG on purpose: rallyrl must isolate it (runs stay bit-identical)."""

    def __init__(self, turns: int = 2, fail_on_prompt: str | None = None, vary: bool = False) -> None:
        self.turns, self.n, self.fail_on, self.vary = turns, 0, fail_on_prompt, vary

    def reset(self, record):
        random.random()
        if self.vary:  # 1..turns turns, by prompt: ranks run different numbers of turns
            self.turns = 1 + sum(map(ord, str(record["prompt"]))) % self.turns
        if self.fail_on is not None and self.fail_on in str(record["prompt"]) and os.environ.get("RANK", "0") == "1":
            raise RuntimeError("the board is broken")
        return None

    def step(self, message):
        self.n += 1
        random.random()
        text = message["content"]
        reward = round(deterministic_score("echo", text), 3)
        return [{"role": "user", "content": f"you said {len(text)} characters"}], self.n >= self.turns, reward


def episode_reward(samples, prompts, outputs, **kwargs):
    """The trlx signature with a transcript: the reward depends on every turn (and checks the kwargs)."""
    for key in ("messages", "turn_texts", "turn_token_ids", "tool_calls", "env_rewards", "truncated"):
        assert len(kwargs[key]) == len(samples), key
    out = []
    for p, o, texts, ids in zip(prompts, outputs, kwargs["turn_texts"], kwargs["turn_token_ids"]):
        assert o == "\n".join(texts) and len(texts) == len(ids)
        out.append(deterministic_score(p, o) + 0.1 * len(texts))
    return out


def count_words(text: str) -> int:
    """Count the words of a text.

    Args:
        text: the text
    """
    return len(text.split())


def tool_env() -> ToolEnv:
    return ToolEnv([count_words])


def episode_metric(samples, prompts, outputs, **kwargs):
    """A metric_fn over episodes: it gets the transcript too."""
    return {"turns_seen": [float(len(t)) for t in kwargs["turn_texts"]]}
