"""Environment tokens from the chat template's DELTA, with a prefix check.

The trained tokens of an assistant turn are the sampled ids, never re-encoded. What the environment
adds (tool results, a user's reply, the next generation prompt) is turned into tokens by rendering the
conversation with the tokenizer's chat template twice, before and after the new messages, and taking
the difference:

    a = render(conversation up to and including the assistant turn)                 # no generation prompt
    b = render(conversation + the environment's messages, add_generation_prompt)
    b[:len(a)] == a  (token ids)  ->  environment tokens = closing of the turn + b[len(a):]

The "closing of the turn" is what the template writes after an assistant message's content (ChatML:
``<|im_end|>\\n``), found by rendering the same conversation with a sentinel as the assistant's content.
The part of it the model sampled itself (its end-of-turn token, an action) is not repeated; the rest
(the ``\\n`` after ``<|im_end|>``, or the whole closing when the turn was cut by ``max_new_tokens`` or a
stop string) belongs to the environment.

A template that rewrites earlier turns when a message is added (Qwen3-style templates drop the
``<think>`` blocks of earlier assistant turns) fails the prefix check: then ``b`` is not "what came
before plus something", and no delta is right. ``TemplateDrift`` says so, naming the turn and the first
token where the renders differ; the episode loop either fails (``env.on_template_drift: fail``, the
default) or starts a new training row from ``b`` (``fork``).
"""

from __future__ import annotations

from typing import Any

# The stand-in content that finds where an assistant message's content ends in a render. Plain text
# no template alters (no whitespace to trim, no markup to parse).
SENTINEL = "RALLYRL-ASSISTANT-CONTENT-7f3a"


class TemplateError(ValueError):
    """The chat template cannot be used for multi-turn episodes (it does not render an assistant turn's
    content verbatim, its end-of-turn markup does not tokenize apart, or it fails on the messages)."""


class TemplateDrift(TemplateError):
    """The render after an environment step does not begin with the render before it (token ids)."""

    def __init__(self, message: str, rerendered: list[int]) -> None:
        super().__init__(message)
        self.rerendered = rerendered  # b: the whole conversation re-rendered (a fork's new query)


class ChatRenderer:
    """The tokenizer's chat template over one conversation, as token ids (``tools``: JSON schemas)."""

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]] | None = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError("multi-turn episodes (env.factory) need a tokenizer with a chat template: the "
                                "environment's messages are turned into tokens by rendering the conversation; "
                                "set tokenizer.chat_template (and save_pretrained it) or use model.tokenizer_path")
        self.tokenizer, self.tools = tokenizer, tools or None

    def text(self, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        try:
            out = self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                                     add_generation_prompt=generation_prompt)
        except Exception as e:
            raise TemplateError(f"the chat template failed on the conversation ({len(messages)} messages, "
                                f"roles {[m['role'] for m in messages]}): {type(e).__name__}: {e}") from None
        if not isinstance(out, str):
            raise TemplateError(f"the chat template rendered {type(out).__name__}, not text")
        return out

    def encode(self, text: str) -> list[int]:
        # The template writes its own special tokens (BOS, ...); adding them again would double them
        # (the same rule as rallyrl.inputs.tokenize_prompts for rendered prompts).
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def ids(self, messages: list[dict[str, Any]], generation_prompt: bool) -> list[int]:
        return self.encode(self.text(messages, generation_prompt))

    def closing(self, conversation: list[dict[str, Any]]) -> list[int]:
        """The tokens the template writes after the content of the conversation's last (assistant)
        message, and checks that they end the render of ``conversation`` as separate tokens."""
        probe = conversation[:-1] + [{**conversation[-1], "content": SENTINEL}]
        text = self.text(probe, False)
        at = text.rfind(SENTINEL)
        if at < 0:
            raise TemplateError("the chat template does not write an assistant message's content verbatim (a "
                                "stand-in content was not found in its render), so the end of an assistant turn "
                                "cannot be located")
        tail = text[at + len(SENTINEL):]
        return self.encode(tail) if tail else []

    def delta(self, conversation: list[dict[str, Any]], new: list[dict[str, Any]], sampled: list[int],
              turn: int) -> list[int]:
        """The environment tokens after assistant turn ``turn`` (1-based): ``conversation`` ends with that
        turn's message, ``new`` are the environment's messages, ``sampled`` the turn's sampled ids.
        Raises ``TemplateDrift`` when the template is not prefix-preserving at this step."""
        a_text = self.text(conversation, False)
        a = self.encode(a_text)
        b = self.ids(conversation + new, True)
        if b[: len(a)] != a:
            raise TemplateDrift(self._drift_message(a, b, turn, new), b)
        close = self.closing(conversation)
        if close and a[-len(close):] != close:
            raise TemplateError(
                f"turn {turn}: the chat template's end of an assistant turn ({self.tokenizer.decode(close)!r}) does "
                f"not end the render as separate tokens (it merges with the content), so the environment's "
                f"tokens cannot be cut from the render")
        # The longest start of the closing that the model sampled itself (its end-of-turn token): an action,
        # already in the row; the rest of the closing is the environment's.
        j = next((k for k in range(min(len(close), len(sampled)), 0, -1) if sampled[-k:] == close[:k]), 0)
        return close[j:] + b[len(a):]

    def _drift_message(self, a: list[int], b: list[int], turn: int, new: list[dict[str, Any]]) -> str:
        at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        dec = self.tokenizer.decode
        roles = ", ".join(m["role"] for m in new) or "none"
        return (f"the chat template is not prefix-preserving at turn {turn}: after the environment's messages "
                f"({roles}) the conversation renders differently BEFORE them, from token {at} on: "
                f"{dec(a[at:at + 12])!r}... became {dec(b[at:at + 12])!r}... (it rewrites earlier turns, as "
                f"templates that drop earlier <think> blocks do), so the environment's tokens are not a delta of "
                f"the render. Use a template that keeps every earlier turn as it was, or set "
                f"env.on_template_drift: fork to start a new training row from the re-rendered conversation")
