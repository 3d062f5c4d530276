"""``PromptSet``: prompts read by global index, rendered and tokenized as an iteration draws them, with
the length rule applied (``data.max_prompt_tokens``, ``data.long_prompts``: docs/data.md)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from .lengths import cached_lengths, say
from .records import DataError, check_messages
from .render import PromptLimit, check_not_empty, encode_prompts, render_prompts, require_template
from .sampler import PromptSampler
from .tables import ListTable, PromptTable


class Row(NamedTuple):
    record: dict[str, Any]  # {"prompt": text (rendered), ...metadata}
    ids: list[int]  # what the model is given (the last limit.tokens of them under truncate_left)
    n: int  # the prompt's own token count (len(ids) unless truncated)


class PromptSet:
    """Prompts read by global index from a ``PromptTable``: ``texts`` / ``metadata`` / ``token_ids`` of
    rows. A conversational prompt is rendered here: ``prompt`` is the chat template's text and the
    ``prompt_messages`` column holds the original messages (``render_prompts``).

    ``PromptSet.of(table, ...)`` renders and tokenizes lazily: ``draw(sampler, k)`` / ``prepare(idx)``
    (called with an iteration's drawn prompts, on every rank) render, tokenize and check those rows and
    keep only them, so a long run over a big data set never accumulates them all. ``prepare_all()`` does
    every row once and keeps them (inline lists and the eval set: small, checked up front).
    ``PromptSet(records, query_ids)`` wraps rows rendered and tokenized already.

    A prompt longer than ``limit.tokens`` follows ``limit.mode``: ``error`` raises naming the row,
    ``truncate_left`` keeps its last ``limit.tokens`` ids (the record's text, which the reward function
    sees, stays whole), ``skip`` leaves it out of ``draw`` (replaced by the next rows of the shared order)."""

    def __init__(self, records: list[dict[str, Any]] | None = None, query_ids: list[list[int]] | None = None,
                 ) -> None:
        records, query_ids = records or [], query_ids or []
        self.table: PromptTable = ListTable(records, "prompts")
        self._cache: dict[int, Row] = {i: Row(r, q, len(q)) for i, (r, q) in enumerate(zip(records, query_ids))}
        self._pinned = True
        self._tokenizer: Any = None
        self.limit = PromptLimit(None)
        self._drew = {"truncated": 0, "skipped": 0}  # in the last draw
        self._noted = False
        self._lengths: np.ndarray | None = None  # every row's token count, once asked for (lengths())

    @classmethod
    def of(cls, table: PromptTable, tokenizer: Any, max_positions: int | None, max_new_tokens: int,
           what: str, tokenizer_key: str = "the tokenizer", limit: PromptLimit | None = None) -> PromptSet:
        """``limit``: the length rule (default: the model's positions minus ``max_new_tokens``, ``error``)."""
        self = cls()
        self.table, self._pinned = table, False
        self._tokenizer, self._what, self._tok_key = tokenizer, what, tokenizer_key
        self.limit = limit or PromptLimit.of(None, "error", max_positions, max_new_tokens)
        if table.chat:  # checked now, for the whole set: a template-less tokenizer fails on the first row
            require_template(tokenizer, table.first_chat, what, tokenizer_key)
        return self

    def __len__(self) -> int:
        return len(self.table)

    # --- an iteration's rows -------------------------------------------------------------------------
    def draw(self, sampler: PromptSampler, k: int) -> list[int]:
        """The next ``k`` prompts of the shared order, prepared (``prepare``). Under ``skip`` a long row is
        left out and the next rows of the order take its place, so every iteration has ``k`` prompts; the
        rows are the same on every rank (every rank prepares all of them), and the sampler's state after
        the draw covers the replacements, so a resumed run draws exactly what an uninterrupted one does."""
        drawn = sampler.next(k)
        self.prepare(drawn)
        long = [i for i in drawn if self.limit.is_long(self._cache[i].n)]
        self._drew = {"truncated": 0, "skipped": 0}
        if long and not self._noted:
            self._note(long[0])
        if long and self.limit.mode == "skip":
            skip = set(long)
            drawn = self._refill([i for i in drawn if i not in skip], sampler, k, long)
        elif long:  # truncate_left (error raised in prepare)
            self._drew["truncated"] = len(long)
        return drawn

    def _refill(self, kept: list[int], sampler: PromptSampler, k: int, long: list[int]) -> list[int]:
        """Draw on until ``k`` rows are not long; a set whose every row is long is an error."""
        skipped, seen = len(long), set(long)
        while len(kept) < k:
            if len(seen) == len(self):
                raise self._all_long()
            more = sampler.next(k - len(kept))
            self._add(more)
            for i in more:
                if self.limit.is_long(self._cache[i].n):
                    seen.add(i)
                    skipped += 1
                else:
                    kept.append(i)
        if not self._pinned:  # keep only the rows this iteration trains on
            self._cache = {i: self._cache[i] for i in dict.fromkeys(kept)}
        self._drew["skipped"] = skipped
        return kept

    def _all_long(self) -> DataError:
        return DataError(f"{self._what}: every prompt of {self.table.where} is longer than {self.limit.describe()}, "
                         f"so data.long_prompts: skip leaves none; raise data.max_prompt_tokens (within the model's "
                         f"positions), lower generation.max_new_tokens, or set data.long_prompts: truncate_left")

    def draw_metrics(self) -> dict[str, float]:
        """``data/truncated_prompts`` / ``data/skipped_prompts`` of the last draw, each only when not 0 (so
        a run with no long prompt logs exactly the keys it always did)."""
        return {f"data/{k}_prompts": float(v) for k, v in self._drew.items() if v}

    def _note(self, row: int) -> None:
        """One line on stderr (main rank), the first time a long row is met in this process."""
        self._noted = True
        r, truncate = self._cache[row], self.limit.mode == "truncate_left"
        say(f"rallyrl: note: {self._what}: prompt {row} has {r.n} tokens, more than {self.limit.describe()}: "
            f"{f'its first {r.n - len(r.ids)} tokens dropped' if truncate else 'skipped'} (data.long_prompts: "
            f"{self.limit.mode}); each iteration counts such prompts in "
            f"{'data/truncated_prompts' if truncate else 'data/skipped_prompts'}")

    def prepare(self, idx: Sequence[int]) -> None:
        """Render, tokenize and check the rows ``idx`` (an iteration's draw) and keep only them. The
        drawn rows are the same on every rank, so a bad row raises the same ``ConfigError`` / ``DataError``,
        naming it, on every rank at the same point, with no collective."""
        if self._pinned:
            return
        want = list(dict.fromkeys(int(i) for i in idx))
        missing = [i for i in want if i not in self._cache]
        loaded = dict(zip(missing, self._load(missing)))
        self._cache = {i: self._cache[i] if i in self._cache else loaded[i] for i in want}

    def _add(self, idx: Sequence[int]) -> None:
        """Prepare ``idx`` beside the rows already kept."""
        missing = [i for i in dict.fromkeys(int(i) for i in idx) if i not in self._cache]
        self._cache.update(zip(missing, self._load(missing)))

    # --- the whole set -------------------------------------------------------------------------------
    def prepare_all(self, block: int = 4096, drop_long: bool = False) -> None:
        """Every row, kept for the run (a small set: inline prompts, the eval set). ``drop_long`` (the eval
        set under ``skip``): long rows are left out and the rest renumbered 0..n-1; a set whose every
        row is long is an error."""
        if self._pinned:
            return
        n = len(self)
        for lo in range(0, n, block):
            self._add(range(lo, min(n, lo + block)))
        self._pinned = True
        long = [i for i in range(n) if self.limit.is_long(self._cache[i].n)]
        if not long:
            return
        if self.limit.mode == "skip" and len(long) == n:
            raise self._all_long()
        if drop_long:  # the eval set: said once, here
            if self.limit.mode == "skip":
                skip = set(long)
                kept = [self._cache[i] for i in range(n) if i not in skip]
                self._cache = dict(enumerate(kept))
                self.table = ListTable([r.record for r in kept], self._what, self.table.where)
            say(f"rallyrl: note: {self._what}: {len(long)} of {n} prompts are longer than {self.limit.describe()}: "
                f"{'left out' if self.limit.mode == 'skip' else 'truncated on the left'} (data.long_prompts: "
                f"{self.limit.mode})")

    def lengths(self) -> np.ndarray:
        """Every row's token count (before any truncation), from the length index (built once per table,
        tokenizer and chat template, then cached: ``rallyrl.data.lengths``). Building it renders and
        tokenizes every row, so it also runs every check a draw makes."""
        if self._pinned:
            return np.array([self._cache[i].n for i in range(len(self))], dtype=np.int32)
        if self._lengths is None:
            self._lengths = cached_lengths(self.table, self._tokenizer,
                                           lambda idx: [r.n for r in self._load(idx, limit=False)], self._what)
        return self._lengths

    def longest(self) -> int:
        """The most tokens of any prompt (``rallyrl check``: every row is read once, or its length found in
        the index, so every check a draw makes has run; under ``error`` a long row raises its error)."""
        self.check_lengths()
        lengths = self.lengths()
        return int(lengths.max()) if len(lengths) else 0

    def long_rows(self) -> np.ndarray:
        """The rows longer than ``limit.tokens``."""
        if self.limit.tokens is None:
            return np.zeros(0, dtype=np.int64)
        return np.flatnonzero(self.lengths() > self.limit.tokens)

    def long_summary(self) -> str:
        """For ``rallyrl check``: how many rows are longer than the limit and what the run does with them
        ("" when none is)."""
        long = self.long_rows()
        if not len(long):
            return ""
        done = "skipped when drawn" if self.limit.mode == "skip" else "truncated on the left"
        return (f"; {len(long)} longer than {self.limit.describe()}, first prompt {int(long[0])}: {done} "
                f"(data.long_prompts: {self.limit.mode})")

    def check_lengths(self) -> None:
        """``data.long_prompts: error``, at start: a ``ConfigError`` naming the first long row (the same
        error its draw would raise), after one look at every row's length (the cached index)."""
        if self.limit.tokens is None or self.limit.mode != "error":
            return
        long = self.long_rows()
        if len(long):
            if self._pinned:  # a set checked up front never holds one; kept for a set built by hand
                row = self._cache[int(long[0])]
                raise self.limit.too_long(self._what, int(long[0]), row.n, row.record["prompt"])
            self._load([int(long[0])])  # raises the row's own error (its text in the message)

    # --- reading rows --------------------------------------------------------------------------------
    def _rows(self, idx: Sequence[int]) -> list[Row]:
        missing = [i for i in dict.fromkeys(idx) if i not in self._cache]
        if missing:  # a row not prepared (a caller outside the loop): read it, without evicting the others
            self._cache.update(zip(missing, self._load(missing)))
        return [self._cache[i] for i in idx]

    def _load(self, idx: list[int], limit: bool = True) -> list[Row]:
        """Rows read, rendered, tokenized and checked; ``limit``: the length rule applied (else every row
        comes whole, for the length index)."""
        if not idx:
            return []
        raw = self.table.rows(idx)
        if self.table.chat and not self.table.eager:  # Arrow rows: checked as they are drawn
            for i, r in zip(idx, raw):
                if isinstance(r["prompt"], list):
                    check_messages(r["prompt"], f"prompt {i}", self._what)
        records, chat = render_prompts(raw, self._tokenizer, self._what, self._tok_key, index=idx,
                                       set_chat=self.table.chat)
        ids = encode_prompts(records, self._tokenizer, chat)
        check_not_empty(ids, records, self._what, idx)
        rows = [Row(r, q, len(q)) for r, q in zip(records, ids)]
        if not limit or self.limit.tokens is None:
            return rows
        for j, row in enumerate(rows):
            if self.limit.is_long(row.n):
                if self.limit.mode == "error":
                    raise self.limit.too_long(self._what, idx[j], row.n, row.record["prompt"])
                if self.limit.mode == "truncate_left":  # the last tokens: what generation continues from
                    rows[j] = row._replace(ids=row.ids[-self.limit.tokens:])
        return rows

    def texts(self, idx: Sequence[int]) -> list[str]:
        return [r.record["prompt"] for r in self._rows(idx)]

    def metadata(self, idx: Sequence[int]) -> list[dict[str, Any]]:
        """Every column but the prompt (what reaches the reward function as per-sample kwargs)."""
        return [{k: v for k, v in r.record.items() if k != "prompt"} for r in self._rows(idx)]

    def token_ids(self, idx: Sequence[int]) -> list[list[int]]:
        return [r.ids for r in self._rows(idx)]
