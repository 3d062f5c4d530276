"""Prompt loading and the shared prompt order.

A prompt record is a dict with a ``"prompt"`` and any number of metadata columns; the metadata reaches
the reward function as per-sample lists aligned with the samples. The prompt is a string, or a
conversation: a list of chat messages (``[{"role": "user", "content": ...}, ...]``), which
``rallyrl.inputs`` renders with the tokenizer's chat template (it needs the tokenizer, loading does not).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from .config import read_text


class DataError(ValueError):
    """Prompts could not be loaded or are malformed."""


def load_prompts(source: str | Path | list[Any], what: str = "data.prompts") -> list[dict[str, Any]]:
    """Load prompts from a ``.jsonl`` / ``.txt`` path or an inline list (strings, conversations or
    dicts). Conversations are checked (``check_messages``) but not rendered here."""
    if isinstance(source, (str, Path)):
        path = Path(source)
        if not path.is_file():
            raise DataError(f"{what}: file not found: {path}")
        if path.suffix == ".jsonl":
            records = []
            for lineno, line in enumerate(read_text(path, what + ":", DataError).splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{what}: {path}:{lineno} is not valid JSON: {e}") from None
                records.append(_record(rec, f"{path}:{lineno}", what))
        elif path.suffix == ".txt":
            lines = read_text(path, what + ":", DataError).splitlines()
            records = [{"prompt": line} for line in lines if line.strip()]
        else:
            raise DataError(f"{what}: {path} must be a .jsonl or .txt file")
    elif isinstance(source, list):
        records = [_record(r, f"item {i}", what) for i, r in enumerate(source)]
    else:
        raise DataError(f"{what}: expected a path or a list, got {type(source).__name__}")
    if not records:
        raise DataError(f"{what}: no prompts in {source if not isinstance(source, list) else 'the list'}")
    return records


# The reward/metric keyword argument that carries a conversational prompt's original messages (the
# rendered text is the prompt itself); a record with a conversation may not use it as a column.
MESSAGES_KEY = "prompt_messages"


def _record(rec: Any, where: str, what: str) -> dict[str, Any]:
    if isinstance(rec, str):
        return {"prompt": rec}
    if isinstance(rec, list):  # a bare conversation
        return {"prompt": check_messages(rec, where, what)}
    if isinstance(rec, dict):
        prompt = rec.get("prompt")
        if isinstance(prompt, list):
            check_messages(prompt, where, what)
            if MESSAGES_KEY in rec:
                raise DataError(f"{what}: {where} has a '{MESSAGES_KEY}' column, a name rallyrl uses for the "
                                f"messages of a conversational prompt; rename the column")
        elif not isinstance(prompt, str):
            raise DataError(f"{what}: {where} has no 'prompt' field that is a string or a list of chat messages")
        return dict(rec)
    raise DataError(f"{what}: {where} must be a string, a list of chat messages or an object with a 'prompt', "
                    f"got {type(rec).__name__}")


def check_messages(messages: list[Any], where: str, what: str) -> list[dict[str, Any]]:
    """A conversation must be a non-empty list of ``{"role": str, "content": str | list, ...}`` dicts
    (further keys, e.g. ``name``, are passed to the chat template as they are)."""
    if not messages:
        raise DataError(f"{what}: {where}: the list of chat messages is empty")
    for j, m in enumerate(messages):
        if not isinstance(m, dict):
            raise DataError(f"{what}: {where}: chat message {j} must be an object with 'role' and 'content', "
                            f"got {type(m).__name__}")
        if not isinstance(m.get("role"), str):
            raise DataError(f"{what}: {where}: chat message {j} has no string 'role'")
        if not isinstance(m.get("content"), (str, list)):
            raise DataError(f"{what}: {where}: chat message {j} has no 'content' (a string, or a list of "
                            f"content parts)")
    return messages


class PromptSampler:
    """An endless stream of prompt indices, identical on every rank (shared seed).

    Each pass over the data is a permutation drawn from ``(seed, epoch)``, so the state is two integers
    and a resumed run continues the exact same stream.
    """

    def __init__(self, n: int, seed: int, shuffle: bool = True) -> None:
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self.epoch, self.pos = 0, 0
        self._perm = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.n)
        from .seeding import stream_seed

        return np.random.default_rng([stream_seed(self.seed, "prompt_order"), epoch]).permutation(self.n)

    def next(self, k: int) -> list[int]:
        out: list[int] = []
        while len(out) < k:
            take = min(k - len(out), self.n - self.pos)
            out.extend(int(i) for i in self._perm[self.pos : self.pos + take])
            self.pos += take
            if self.pos == self.n:
                self.epoch, self.pos = self.epoch + 1, 0
                self._perm = self._permutation(self.epoch)
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos, "n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["n"] != self.n:
            raise DataError(f"checkpoint was made with {state['n']} prompts, the data now has {self.n}")
        self.epoch, self.pos = state["epoch"], state["pos"]
        self._perm = self._permutation(self.epoch)
