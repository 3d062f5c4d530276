"""Prompt records in Python: the reader of inline lists (and of a ``.jsonl`` / ``.txt`` that does not
convert to Arrow), with every row checked, and the checks of a conversation's messages."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..config import read_text


class DataError(ValueError):
    """Prompts could not be loaded or are malformed."""


def load_prompts(source: str | Path | list[Any], what: str = "data.prompts", prompt_column: str = "prompt"
                 ) -> list[dict[str, Any]]:
    """Load prompts from a ``.jsonl`` / ``.txt`` path or an inline list (strings, conversations or
    dicts) into Python records, every row checked. Conversations are checked (``check_messages``) but
    not rendered here. ``open_prompts`` is what a run uses (any source, any size); this reader is its
    backend for inline lists and, for a ``.jsonl``/``.txt``, the path that names ``file:line`` when a
    file does not convert to Arrow."""
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
                records.append(_record(rec, f"{path}:{lineno}", what, prompt_column))
        elif path.suffix == ".txt":
            lines = read_text(path, what + ":", DataError).splitlines()
            records = [{"prompt": line} for line in lines if line.strip()]
        else:
            raise DataError(f"{what}: {path} must be a .jsonl or .txt file")
    elif isinstance(source, list):
        records = [_record(r, f"item {i}", what, prompt_column) for i, r in enumerate(source)]
    else:
        raise DataError(f"{what}: expected a path or a list, got {type(source).__name__}")
    if not records:
        raise DataError(f"{what}: no prompts in {source if not isinstance(source, list) else 'the list'}")
    return records


# The reward/metric keyword argument that carries a conversational prompt's original messages (the
# rendered text is the prompt itself); a record with a conversation may not use it as a column.
MESSAGES_KEY = "prompt_messages"


def _record(rec: Any, where: str, what: str, prompt_column: str = "prompt") -> dict[str, Any]:
    if isinstance(rec, str):
        return {"prompt": rec}
    if isinstance(rec, list):  # a bare conversation
        return {"prompt": check_messages(rec, where, what)}
    if isinstance(rec, dict):
        if prompt_column != "prompt" and prompt_column in rec:
            if "prompt" in rec:
                raise DataError(f"{what}: {where} has both a 'prompt' column and data.prompt_column "
                                f"'{prompt_column}'; rallyrl renames '{prompt_column}' to 'prompt', so rename one")
            rec = {"prompt": rec[prompt_column], **{k: v for k, v in rec.items() if k != prompt_column}}
        prompt = rec.get("prompt")
        if isinstance(prompt, list):
            check_messages(prompt, where, what)
            if MESSAGES_KEY in rec:
                raise DataError(f"{what}: {where} has a '{MESSAGES_KEY}' column, a name rallyrl uses for the "
                                f"messages of a conversational prompt; rename the column")
        elif not isinstance(prompt, str):
            raise DataError(f"{what}: {where} has no '{prompt_column}' field that is a string or a list of chat "
                            f"messages")
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
