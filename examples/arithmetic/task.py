"""The arithmetic task: short word problems with small whole numbers, generated locally, and their rewards.

Problems are drawn from a seeded ``random.Random``: a name, an object, two operands and an operation
(addition; subtraction with a non-negative result), put into one of a few sentence templates, e.g.

    "Mia has 3 apples. She gets 4 more apples. How many apples does Mia have now?"   -> 7

:func:`make_problems` returns dicts ``{"question", "answer", "a", "b", "op"}``; the train and eval sets
come from different seeds and share no question (:func:`train_and_eval`). Pure Python (no torch), so the
rewards are cheap and the generator is unit-tested.

Rewards (the config weights them, ``reward.fns``):

- :func:`correct_reward`: 1.0 when the LAST whole number in the response equals the answer, else 0.0
  (exact match on the final number, as GSM8K-style graders do).
- :func:`format_reward`: 1.0 when the response is just a number (``"7"``, ``"7."``, ``" 7\\n"``), else
  0.0; a small weight makes short, parseable answers preferred.

:func:`metric_fn` logs ``eval/correct`` (values in {0, 1}) and ``eval/format``.
"""

from __future__ import annotations

import random
import re
from typing import Any, Dict, List, Sequence

__all__ = ["make_problems", "train_and_eval", "final_number", "correct_reward", "format_reward",
           "reward_fn", "metric_fn", "INSTRUCTION"]

NAMES = [("Mia", "She", "her"), ("Tom", "He", "his"), ("Ana", "She", "her"), ("Ben", "He", "his"),
         ("Lily", "She", "her"), ("Sam", "He", "his"), ("Zoe", "She", "her"), ("Max", "He", "his"),
         ("Emma", "She", "her"), ("Leo", "He", "his"), ("Ivy", "She", "her"), ("Jack", "He", "his")]
OBJECTS = ["apples", "books", "pencils", "marbles", "cookies", "stickers", "coins", "cards", "shells",
           "balloons", "stamps", "flowers"]
ADD = [
    "{n} has {a} {o}. {P} gets {b} more {o}. How many {o} does {n} have now?",
    "{n} had {a} {o} and found {b} more. How many {o} does {n} have?",
    "There are {a} {o} in a box. {n} puts {b} more {o} in the box. How many {o} are in the box now?",
]
SUB = [
    "{n} has {a} {o}. {P} gives {b} {o} to a friend. How many {o} does {n} have left?",
    "{n} had {a} {o} and lost {b} of them. How many {o} does {n} have now?",
    "There are {a} {o} on a table. {n} takes {b} of them. How many {o} are left on the table?",
]
# Appended to every question: the format reward asks for exactly this.
INSTRUCTION = "Answer with the number only."

_INT = re.compile(r"-?\d+")
_JUST_A_NUMBER = re.compile(r"\s*-?\d+\s*\.?\s*")


def make_problems(n: int, seed: int, max_operand: int = 9, ops: Sequence[str] = ("+", "-"),
                  exclude: set[str] | None = None) -> List[Dict[str, Any]]:
    """``n`` distinct problems drawn from ``random.Random(seed)``: operands in 0..``max_operand`` (for
    ``-``, ``a >= b`` so the answer is not negative), questions not in ``exclude``. Deterministic."""
    rng = random.Random(seed)
    exclude = set(exclude or ())
    out: List[Dict[str, Any]] = []
    seen: set[str] = set()
    tries = 0
    while len(out) < n:
        tries += 1
        if tries > 100 * n + 1000:
            raise ValueError(f"could not draw {n} distinct problems (max_operand={max_operand}, ops={ops})")
        op = rng.choice(list(ops))
        name, pronoun, _ = rng.choice(NAMES)
        obj = rng.choice(OBJECTS)
        a, b = rng.randint(0, max_operand), rng.randint(1, max_operand)
        if op == "-":
            a, b = max(a, b), min(a, b)
        template = rng.choice(ADD if op == "+" else SUB)
        question = template.format(n=name, P=pronoun, a=a, b=b, o=obj)
        if question in seen or question in exclude:
            continue
        seen.add(question)
        out.append({"question": question, "answer": a + b if op == "+" else a - b, "a": a, "b": b, "op": op})
    return out


def train_and_eval(n_train: int = 1024, n_eval: int = 100, seed: int = 0, **kw: Any
                   ) -> tuple[List[Dict[str, Any]], List[Dict[str, Any]]]:
    """The train set (seed ``seed``) and a held-out eval set (seed ``seed + 1``) with no train question."""
    eval_set = make_problems(n_eval, seed + 1, **kw)
    train = make_problems(n_train, seed, exclude={p["question"] for p in eval_set}, **kw)
    return train, eval_set


def final_number(text: str) -> int | None:
    """The last whole number in ``text`` (``None`` if there is none)."""
    found = _INT.findall(text)
    return int(found[-1]) if found else None


def correct_reward(samples: Sequence[str], prompts: Sequence[str], outputs: Sequence[str],
                   answer: Sequence[int] = (), **kwargs: Any) -> List[float]:
    """1.0 when the last whole number of the response equals the ``answer`` metadata column, else 0.0."""
    return [1.0 if final_number(o) == int(a) else 0.0 for o, a in zip(outputs, answer, strict=True)]


def format_reward(samples: Sequence[str], prompts: Sequence[str], outputs: Sequence[str],
                  **kwargs: Any) -> List[float]:
    """1.0 when the response is just a number (optionally followed by a period), else 0.0."""
    return [1.0 if _JUST_A_NUMBER.fullmatch(o) else 0.0 for o in outputs]


def reward_fn(samples: Sequence[str], prompts: Sequence[str], outputs: Sequence[str],
              answer: Sequence[int] = (), **kwargs: Any) -> List[float]:
    """``correct + 0.1 * format`` in one function (the configs use ``reward.fns`` instead, to log both)."""
    c = correct_reward(samples, prompts, outputs, answer=answer)
    f = format_reward(samples, prompts, outputs)
    return [x + 0.1 * y for x, y in zip(c, f)]


def metric_fn(samples: Sequence[str], prompts: Sequence[str], outputs: Sequence[str],
              answer: Sequence[int] = (), **kwargs: Any) -> Dict[str, List[float]]:
    """``eval/correct`` (1 for an exact final number, else 0) and ``eval/format``."""
    return {"correct": correct_reward(samples, prompts, outputs, answer=answer),
            "format": format_reward(samples, prompts, outputs)}
