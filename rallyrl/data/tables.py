"""The prompt store: rows read by global index, from Python records or a memory-mapped Arrow table,
and the checks that an Arrow table allows up front (the schema, nulls, message structs)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .records import MESSAGES_KEY, DataError


class PromptTable:
    """Prompt rows read by global index ``0..n-1``: ``rows(idx)`` gives records ``{"prompt": str or
    messages, ...metadata}`` in the order asked. ``chat`` says whether the set holds conversations (then
    every record of it carries ``prompt_messages`` once rendered); ``first_chat`` is the first such row.
    ``eager``: small (an inline list), so every row is checked up front; otherwise rows are rendered,
    tokenized and checked when an iteration draws them (``rallyrl.inputs.PromptSet``)."""

    what: str
    where: str  # the source, for messages
    chat: bool
    first_chat: int
    eager: bool

    def __len__(self) -> int:
        raise NotImplementedError

    def rows(self, idx: Sequence[int]) -> list[dict[str, Any]]:
        raise NotImplementedError

    def columns(self) -> list[str]:
        """The metadata columns the reward function gets as keyword arguments (every column but the
        prompt, plus ``prompt_messages`` in a set of conversations), known without reading the rows."""
        raise NotImplementedError


class ListTable(PromptTable):
    """Python records (an inline list, or a ``.jsonl`` that only Python can type: see ``open_prompts``)."""

    def __init__(self, records: list[dict[str, Any]], what: str, where: str = "the list", eager: bool = True):
        self.records, self.what, self.where, self.eager = records, what, where, eager
        chat = [i for i, r in enumerate(records) if isinstance(r["prompt"], list)]
        self.chat, self.first_chat = bool(chat), (chat[0] if chat else -1)

    def __len__(self) -> int:
        return len(self.records)

    def rows(self, idx: Sequence[int]) -> list[dict[str, Any]]:
        return [self.records[i] for i in idx]

    def columns(self) -> list[str]:
        cols: dict[str, None] = {}
        for r in self.records:
            cols.update(dict.fromkeys(k for k in r if k != "prompt"))
        return list(cols) + ([MESSAGES_KEY] if self.chat else [])


class ArrowTable(PromptTable):
    """A ``datasets.Dataset`` (memory-mapped Arrow) whose prompt column is already named ``prompt``;
    rows are read through datasets (its features decode, e.g., messages stored as JSON). ``row_map``
    maps a row index to a row of the Dataset (a ``.txt`` without its blank lines)."""

    eager = False

    def __init__(self, ds: Any, what: str, where: str, chat: bool, row_map: np.ndarray | None = None):
        self._ds, self._map = ds, row_map  # the Dataset keeps the memory map alive
        self.what, self.where, self.chat, self.first_chat = what, where, chat, (0 if chat else -1)
        self._n = len(row_map) if row_map is not None else len(ds)

    def __len__(self) -> int:
        return self._n

    def columns(self) -> list[str]:
        return [c for c in self._ds.column_names if c != "prompt"] + ([MESSAGES_KEY] if self.chat else [])

    def rows(self, idx: Sequence[int]) -> list[dict[str, Any]]:
        if not len(idx):
            return []
        take = np.asarray(idx, dtype=np.int64)
        if self._map is not None:
            take = self._map[take]
        batch = self._ds[take.tolist()]  # {column: values}, the rows in the order asked
        cols = list(batch)
        out = [dict(zip(cols, vals)) for vals in zip(*batch.values())]
        if self.chat:  # a struct column gives every message every key of the type: drop the absent ones
            for r in out:
                if isinstance(r["prompt"], list):
                    r["prompt"] = [{k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m
                                   for m in r["prompt"]]
        return out


def _user_row(row: int, ds: Any, row_map: np.ndarray | None) -> int | None:
    """A row of the Arrow table as the user counts rows (through an indices mapping and the row map);
    None when the table row is not one of them."""
    for mapping in (ds._indices.column(0).to_numpy() if ds._indices is not None else None, row_map):
        if mapping is not None:
            hit = np.flatnonzero(np.asarray(mapping) == row)
            if not len(hit):
                return None
            row = int(hit[0])
    return row


def _check_message_structs(column: Any, ds: Any, row_map: np.ndarray | None, what: str, where: str) -> None:
    """Conversations typed as lists of ``{role, content, ...}`` structs (every message has the same keys),
    checked vectorised: an empty conversation, a message without a role or content. (Messages whose keys
    differ are stored as JSON by datasets; those are checked when drawn.)"""
    import pyarrow as pa
    import pyarrow.compute as pc

    offset = 0
    for chunk in column.chunks:
        if isinstance(chunk, pa.ExtensionArray) or not pa.types.is_struct(chunk.type.value_type):
            return
        problems = []
        empty = np.flatnonzero(np.asarray(pc.equal(pc.list_value_length(chunk), 0).fill_null(False)))
        if len(empty):
            problems.append((int(empty[0]), "the list of chat messages is empty"))
        flat, parents = pc.list_flatten(chunk), np.asarray(pc.list_parent_indices(chunk))
        for name in ("role", "content"):
            bad = np.flatnonzero(np.asarray(pc.is_null(flat.field(name))))
            if len(bad):
                pos = int(bad[0])
                j = pos - int(np.searchsorted(parents, parents[pos]))  # the message's index in its list
                problems.append((int(parents[pos]), f"chat message {j} has no '{name}'"))
        for row, msg in sorted(problems):
            user_row = _user_row(offset + row, ds, row_map)
            if user_row is not None:
                raise DataError(f"{what}: {where} row {user_row}: {msg}")
        offset += len(chunk)


def _is_chat_feature(feature: Any) -> bool | None:
    """False: strings; True: lists of chat messages (structs with role and content, or JSON objects,
    which is how datasets stores objects whose keys differ); None: neither."""
    import datasets

    if isinstance(feature, datasets.Value):
        return False if feature.dtype in ("string", "large_string") else None
    inner = getattr(feature, "feature", None)
    if type(feature).__name__ not in ("List", "LargeList", "Sequence"):
        return None
    if isinstance(inner, dict):
        return True if {"role", "content"} <= set(inner) else None
    return True if type(inner).__name__ == "Json" else None


def arrow_table(ds: Any, what: str, where: str, prompt_column: str, row_map: np.ndarray | None = None
                 ) -> ArrowTable:
    """Check what is cheap on the Arrow table (the schema and the prompt column's nulls) and wrap it."""
    import pyarrow.compute as pc

    if not len(ds):  # before the column checks: an empty table's columns may have no type at all
        raise DataError(f"{what}: no prompts in {where}")
    cols = list(ds.column_names)
    if prompt_column not in cols:
        raise DataError(f"{what}: {where} has no '{prompt_column}' column (its columns: {cols}); set "
                        f"data.prompt_column to the column that holds the prompts")
    if prompt_column != "prompt":
        if "prompt" in cols:
            raise DataError(f"{what}: {where} has both a 'prompt' column and data.prompt_column "
                            f"'{prompt_column}'; rallyrl renames '{prompt_column}' to 'prompt', so rename one")
        ds = ds.rename_column(prompt_column, "prompt")
    chat = _is_chat_feature(ds.features["prompt"])
    column = ds.data.column("prompt")
    if column.null_count == len(column):  # typed null, or float64 by a csv reader: say it is empty
        raise DataError(f"{what}: {where}: column '{prompt_column}' is empty (null in every row)")
    if chat is None:
        raise DataError(f"{what}: {where}: column '{prompt_column}' holds {ds.features['prompt']}, not strings or "
                        f"lists of chat messages ({{'role', 'content'}} objects)")
    if chat and MESSAGES_KEY in cols:
        raise DataError(f"{what}: {where} has a '{MESSAGES_KEY}' column, a name rallyrl uses for the messages "
                        f"of a conversational prompt; rename the column")
    if chat:
        _check_message_structs(column, ds, row_map, what, where)
    if column.null_count:  # a row without a prompt: name the first (as the user counts rows)
        nulls = np.flatnonzero(np.concatenate([np.asarray(pc.is_null(c)) for c in column.chunks]))
        for mapping in (ds._indices.column(0).to_numpy() if ds._indices is not None else None, row_map):
            if mapping is not None:
                nulls = np.flatnonzero(np.isin(np.asarray(mapping), nulls))
        if len(nulls):
            raise DataError(f"{what}: {where} row {int(nulls[0])} has no '{prompt_column}' (null)")
    table = ArrowTable(ds, what, where, chat, row_map)
    if not len(table):
        raise DataError(f"{what}: no prompts in {where}")
    return table
