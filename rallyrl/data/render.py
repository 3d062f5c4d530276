"""Prompts as the model sees them: conversations rendered with the chat template, token ids, and the
length rule (``data.max_prompt_tokens``, ``data.long_prompts``). The tokenizer is passed in; nothing here
imports ``transformers``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..config import ConfigError
from .records import MESSAGES_KEY, DataError

# data.long_prompts: what a prompt longer than data.max_prompt_tokens does (docs/data.md)
LONG_PROMPTS = ("error", "truncate_left", "skip")


@dataclass(frozen=True)
class PromptLimit:
    """How many tokens a prompt may have and what a longer one does. ``tokens`` None: no limit (a model
    without a position limit, e.g. T5, and no ``data.max_prompt_tokens``); ``explicit``: set by
    ``data.max_prompt_tokens``, else the model's positions minus ``generation.max_new_tokens`` (the limit
    rallyrl always had, so runs without long prompts are unchanged)."""

    tokens: int | None
    mode: str = "error"  # data.long_prompts
    max_positions: int | None = None
    max_new_tokens: int = 0
    explicit: bool = False

    @classmethod
    def of(cls, max_prompt_tokens: int | None, long_prompts: str, max_positions: int | None,
           max_new_tokens: int) -> PromptLimit:
        if long_prompts not in LONG_PROMPTS:
            raise ConfigError(f"data.long_prompts must be one of {list(LONG_PROMPTS)}, got {long_prompts!r}")
        if max_prompt_tokens is not None:
            return cls(max_prompt_tokens, long_prompts, max_positions, max_new_tokens, explicit=True)
        tokens = None if max_positions is None else max_positions - max_new_tokens
        return cls(tokens, long_prompts, max_positions, max_new_tokens)

    def check_room(self) -> None:
        """At start: the limit fits the model (``ConfigError`` naming the keys)."""
        P, n = self.max_positions, self.max_new_tokens
        if self.explicit and P is not None and self.tokens is not None and self.tokens + n > P:
            raise ConfigError(f"data.max_prompt_tokens={self.tokens} with generation.max_new_tokens={n} exceeds the "
                              f"model's {P} positions; set it to at most {P - n} (or null: the most the model allows)")
        if not self.explicit and self.tokens is not None and self.tokens < 1:
            raise ConfigError(f"data.prompts: generation.max_new_tokens={n} leaves no room for a prompt in the "
                              f"model's {P} positions (a prompt needs at least 1); lower generation.max_new_tokens")

    def is_long(self, n: int) -> bool:
        return self.tokens is not None and n > self.tokens

    def describe(self) -> str:
        """The limit, for messages: where it comes from."""
        if self.explicit:
            return f"data.max_prompt_tokens={self.tokens}"
        return (f"{self.tokens} tokens (the model's {self.max_positions} positions minus "
                f"generation.max_new_tokens={self.max_new_tokens})")

    def too_long(self, what: str, i: int, n: int, text: str) -> ConfigError:
        if self.explicit:
            return ConfigError(f"{what}: prompt {i} has {n} tokens, more than data.max_prompt_tokens={self.tokens} "
                               f"({text[:60]!r}...)")
        return ConfigError(f"{what}: prompt {i} has {n} tokens; with generation.max_new_tokens={self.max_new_tokens} "
                           f"that exceeds the model's {self.max_positions} positions ({text[:60]!r}...)")


def require_template(tokenizer: Any, first: int, what: str, tokenizer_key: str) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{what}: prompt {first} is a list of chat messages, but the tokenizer of {tokenizer_key} "
                        f"has no chat template to render it with; use a tokenizer that has one (set "
                        f"model.tokenizer_path, or set tokenizer.chat_template and save_pretrained it), or "
                        f"write the prompts as plain strings")


def render_prompts(records: list[dict[str, Any]], tokenizer: Any, what: str, tokenizer_key: str = "the tokenizer",
                   index: Sequence[int] | None = None, set_chat: bool | None = None
                   ) -> tuple[list[dict[str, Any]], list[bool]]:
    """Conversational prompts rendered with the tokenizer's chat template, as TRL and vLLM do
    (``apply_chat_template(messages, add_generation_prompt=True, tokenize=False)``): the record's
    ``prompt`` becomes the rendered text (what generation continues, what the reward function sees as
    ``prompts[i]`` and what ``rollouts.jsonl`` shows) and ``prompt_messages`` keeps the messages (None
    for a string prompt among them). A set of string prompts only is returned as it is (the same list).
    Also returns which records were conversations. ``index``: the records' global row numbers (for
    messages; default 0..n-1); ``set_chat``: whether the whole set holds conversations, when ``records``
    are only some of its rows (default: whether these do)."""
    index = list(range(len(records))) if index is None else list(index)
    chat = [isinstance(r["prompt"], list) for r in records]
    if not (any(chat) if set_chat is None else set_chat):
        return records, chat
    if any(chat):
        require_template(tokenizer, index[chat.index(True)], what, tokenizer_key)
    out = []
    for i, r, is_chat in zip(index, records, chat):
        if not is_chat:
            # In a set that holds conversations every record has the column (None for a plain prompt),
            # so the reward kwarg is there in every call, whatever prompts a chunk happens to hold.
            if MESSAGES_KEY in r:
                raise DataError(f"{what}: prompt {i} has a '{MESSAGES_KEY}' column, a name rallyrl uses for the "
                                f"messages of conversational prompts (this set has some); rename the column")
            out.append({**r, MESSAGES_KEY: None})
            continue
        try:
            text = tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
        except Exception as e:  # a template that raises on these messages (e.g. "roles must alternate")
            raise DataError(f"{what}: prompt {i}: the chat template of {tokenizer_key} failed on its messages: "
                            f"{type(e).__name__}: {e}") from None
        if not isinstance(text, str):
            raise DataError(f"{what}: prompt {i}: the chat template rendered {type(text).__name__}, not text")
        meta = {k: v for k, v in r.items() if k != "prompt"}
        out.append({"prompt": text, **meta, MESSAGES_KEY: r["prompt"]})
    return out, chat


def tokenize_prompts(records: list[dict[str, Any]], tokenizer: Any, max_positions: int | None,
                     max_new_tokens: int, what: str, rendered: Sequence[bool] = (),
                     index: Sequence[int] | None = None) -> list[list[int]]:
    """Token ids of each (rendered) prompt (``encode_prompts``), every one checked: not empty, and no longer
    than the model's positions leave beside ``max_new_tokens`` (a ``ConfigError`` naming the row: the
    ``data.long_prompts: error`` rule; ``PromptSet`` applies the others). ``index``: the records' global
    row numbers, named in errors (default 0..n-1)."""
    index = list(range(len(records))) if index is None else list(index)
    ids = encode_prompts(records, tokenizer, rendered)
    check_not_empty(ids, records, what, index)
    limit = PromptLimit.of(None, "error", max_positions, max_new_tokens)
    for j, q in enumerate(ids):
        if limit.is_long(len(q)):
            raise limit.too_long(what, index[j], len(q), records[j]["prompt"])
    return ids


def encode_prompts(records: list[dict[str, Any]], tokenizer: Any, rendered: Sequence[bool] = ()) -> list[list[int]]:
    """Token ids of each (rendered) prompt. A plain prompt gets the tokenizer's special tokens (BOS, ...);
    a prompt rendered from a chat template (``rendered[i]``) does not: the template already wrote the
    ones it wants, and adding them again would give, e.g., two BOS tokens (TRL tokenizes rendered
    conversations with ``add_special_tokens=False`` for the same reason)."""
    chat = list(rendered) or [False] * len(records)
    # one batched call per kind (a fast tokenizer encodes a batch in Rust): the same ids as one by one
    ids: list[list[int]] = [[] for _ in records]
    for special in (True, False):
        pos = [j for j, c in enumerate(chat) if c != special]
        if pos:
            enc = tokenizer([records[j]["prompt"] for j in pos], add_special_tokens=special)["input_ids"]
            for j, q in zip(pos, enc):
                ids[j] = q
    return ids


def check_not_empty(ids: list[list[int]], records: list[dict[str, Any]], what: str, index: Sequence[int]) -> None:
    for j, q in enumerate(ids):
        if not q:
            raise ConfigError(f"{what}: prompt {index[j]} tokenizes to nothing ({records[j]['prompt']!r})")
