"""The calculator task: multiplications and additions a 135M model cannot do in its head, a calculator tool
it can call, and the rewards.

Problems (``make_problems``): ``a * b`` with two-digit operands or ``a + b`` with three-digit operands,
from a seeded ``random.Random``; the train and eval sets share no question. Each prompt is a short
conversation: a system message, ONE worked example of the tool in use (a user question, the assistant's
``<tool_call>``, the tool's result, the assistant's answer), then the question. SmolLM2's chat template
does not render tool schemas, so the example shows the format; ``ToolEnv`` with the ``hermes`` parser runs
the calls (``grpo.yaml``: ``env.factory: rallyrl.rollout.env:ToolEnv``).

- :func:`calculator`: the tool, ``+ - * /`` and parentheses on numbers, evaluated safely (``ast``).
- :func:`correct_reward`: 1.0 when the episode's FINAL assistant turn is an answer (not a tool call) whose
  last number is the right result, else 0.0.
- :func:`tool_reward`: 1.0 when the episode ran at least one tool call without an error (the format
  shaping: the pretrained model imitates the example's ``<tool_call>`` but invents the tool's name and
  arguments, so almost no episode is ever right at first; weighted 0.2 in ``grpo.yaml``).
- :func:`metric_fn`: ``eval/correct``, ``eval/used_tool`` (the episode ran at least one call without an
  error) and ``eval/answered`` (its last turn is an answer, not a call).

Pure Python (no torch): cheap rewards and a unit-tested generator.
"""

from __future__ import annotations

import ast
import operator
import random
import re
from typing import Any, Dict, List

__all__ = ["calculator", "make_problems", "train_and_eval", "final_answer", "correct_reward", "tool_reward",
           "metric_fn",
           "SYSTEM", "EXAMPLE"]

SYSTEM = "You are a helpful assistant with a calculator tool."
# The worked example every prompt starts with (what the model imitates).
EXAMPLE = [
    {"role": "user", "content": "What is 12 * 34?"},
    {"role": "assistant", "content": '<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 34"}}</tool_call>'},
    {"role": "tool", "content": "408"},
    {"role": "assistant", "content": "The answer is 408."},
]

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_INT = re.compile(r"-?\d+")


def _eval(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval(node.operand)
    raise ValueError("only numbers, + - * / and parentheses are allowed")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: numbers with + - * / and parentheses, e.g. "12 * 34"
    """
    if len(expression) > 100:
        raise ValueError("the expression is too long")
    value = _eval(ast.parse(expression, mode="eval").body)
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def make_problems(n: int, seed: int, exclude: set[str] | None = None) -> List[Dict[str, Any]]:
    """``n`` distinct problems from ``random.Random(seed)``: half ``a * b`` (11..99), half ``a + b``
    (100..999), none in ``exclude``. Deterministic."""
    rng = random.Random(seed)
    exclude, seen, out = set(exclude or ()), set(), []
    while len(out) < n:
        if rng.random() < 0.5:
            a, b, op = rng.randint(11, 99), rng.randint(11, 99), "*"
        else:
            a, b, op = rng.randint(100, 999), rng.randint(100, 999), "+"
        question = f"What is {a} {op} {b}?"
        if question in seen or question in exclude:
            continue
        seen.add(question)
        out.append({"question": question, "answer": a * b if op == "*" else a + b})
    return out


def train_and_eval(n_train: int = 512, n_eval: int = 100, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """The train set (``seed``) and a held-out eval set (``seed + 1``) that shares no question with it."""
    train = make_problems(n_train, seed)
    return train, make_problems(n_eval, seed + 1, exclude={p["question"] for p in train})


def final_answer(turn_texts: List[str]) -> str | None:
    """The episode's answer: its last assistant turn, unless that turn is a tool call (then None)."""
    if not turn_texts or "<tool_call>" in turn_texts[-1]:
        return None
    return turn_texts[-1]


def _correct(texts: List[str], answer: Any) -> float:
    final = final_answer(texts)
    numbers = _INT.findall(final.replace(",", "")) if final is not None else []
    return 1.0 if numbers and int(numbers[-1]) == int(answer) else 0.0


def correct_reward(samples: List[str], prompts: List[str], outputs: List[str], answer: List[Any],
                   turn_texts: List[List[str]], **kwargs: Any) -> List[float]:
    """1.0 when the final turn answers with the right number (its last number), else 0.0."""
    return [_correct(t, a) for t, a in zip(turn_texts, answer)]


def _used_tool(calls: List[List[dict]]) -> float:
    return float(any(c["error"] is None for turn in calls for c in turn))


def tool_reward(samples: List[str], prompts: List[str], outputs: List[str], tool_calls: List[List[List[dict]]],
                **kwargs: Any) -> List[float]:
    """1.0 when the episode ran at least one tool call without an error, else 0.0."""
    return [_used_tool(calls) for calls in tool_calls]


def metric_fn(samples: List[str], prompts: List[str], outputs: List[str], answer: List[Any],
              turn_texts: List[List[str]], tool_calls: List[List[List[dict]]], **kwargs: Any) -> Dict[str, List[float]]:
    """``correct`` (as the reward), ``used_tool`` (a call that ran without an error) and ``answered``."""
    used = [_used_tool(calls) for calls in tool_calls]
    return {"correct": [_correct(t, a) for t, a in zip(turn_texts, answer)], "used_tool": used,
            "answered": [float(final_answer(t) is not None) for t in turn_texts]}
