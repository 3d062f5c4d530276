"""Prompt loading and the shared prompt order.

A prompt record is a dict with a ``"prompt"`` and any number of metadata columns; the metadata reaches
the reward function as per-sample lists aligned with the samples. The prompt is a string, or a
conversation: a list of chat messages (``[{"role": "user", "content": ...}, ...]``), which
``rallyrl.inputs`` renders with the tokenizer's chat template (it needs the tokenizer, loading does not).

Prompts live in one store, a ``PromptTable`` read by global row index (``open_prompts``). An inline list
is small by nature and stays a list of Python records, checked up front. Every file or data set goes
through ``datasets``: an Arrow table, memory-mapped from the datasets cache (the conversion of a file
happens once, under datasets' lock, and every rank on a node maps the same cache file), so no rank holds
Python objects for the whole data set. ``datasets`` is imported only when such a source is used.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .config import read_text

# File suffixes read through datasets (beside a save_to_disk folder and a data set name).
FILE_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet", ".txt")


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


# ------------------------------------------------------------------------------------------------
# The prompt store: rows by global index


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


def open_prompts(source: str | Path | list[Any], what: str = "data.prompts", prompt_column: str = "prompt",
                 split: str = "train", subset: str | None = None) -> PromptTable:
    """The prompt store of ``data.prompts`` / ``data.eval_prompts`` (``what`` names it in errors); the
    Python API may also pass a ``datasets.Dataset`` / ``DatasetDict``.

    An inline list: Python records, every row checked now (``load_prompts``). A file (``.jsonl``,
    ``.json`` holding a list of objects, ``.csv``, ``.parquet``, ``.txt``), a folder written by
    ``save_to_disk`` (a ``DatasetDict``: its ``split``) or a data set name for ``datasets.load_dataset``
    (``subset``, ``split``): an Arrow table, with what is cheap checked now (the prompt column exists and
    holds strings or chat messages, no row lacks a prompt, the file parses and is UTF-8); what needs the
    tokenizer is checked when a row is drawn. A ``.jsonl``/``.txt`` has the rows it had before (blank
    lines skipped), so the shared prompt order is unchanged."""
    if isinstance(source, list):
        return ListTable(load_prompts(source, what, prompt_column), what)
    if type(source).__module__.split(".")[0] == "datasets":  # train(prompts=Dataset or DatasetDict), as in TRL
        ds_mod = _datasets()
        if isinstance(source, ds_mod.DatasetDict):
            if split not in source:
                key = "data.eval_split" if "eval" in what else "data.split"
                raise DataError(f"{what}: the DatasetDict has no split '{split}' (it has {sorted(source)}); set {key}")
            source = source[split]
        if isinstance(source, ds_mod.Dataset):
            return _arrow_table(source, what, "the Dataset", prompt_column)
    if not isinstance(source, (str, Path)):
        raise DataError(f"{what}: expected a path, a data set name or a list, got {type(source).__name__}")
    path = Path(source).expanduser()
    if path.is_dir():
        return _arrow_table(_load_from_disk(path, split, what), what, str(path), prompt_column)
    suffix = path.suffix.lower()
    if path.is_file():
        if suffix in (".jsonl", ".txt"):
            return _legacy_file(path, suffix, what, prompt_column)
        if suffix not in FILE_SUFFIXES:
            raise DataError(f"{what}: {path} must be a .jsonl, .json, .csv, .parquet or .txt file, a folder "
                            f"written by datasets' save_to_disk, or a data set name")
        return _arrow_table(_convert(path, suffix, what), what, str(path), prompt_column)
    s = str(source)
    if suffix in FILE_SUFFIXES or s.startswith((".", "/", "~")) or os.sep + os.sep in s or s.count("/") > 1:
        raise DataError(f"{what}: file not found: {path}")
    return _arrow_table(_load_hub(s, subset, split, what), what, s, prompt_column)


def _datasets() -> Any:
    import datasets  # ~2.5 s and ~180 MiB: only for files and data sets, never for inline lists

    datasets.disable_progress_bars()  # one bar per rank per conversion would bury the run's own lines
    return datasets


def _legacy_file(path: Path, suffix: str, what: str, prompt_column: str) -> PromptTable:
    """A ``.jsonl`` / ``.txt``: Arrow when it converts and checks out. When it does not (bad JSON, a row
    without a prompt, non-UTF-8, a bare string or a mix of strings and conversations in one column, which
    an Arrow column cannot type), the Python reader reads it: it either raises with ``file:line`` as it
    always has, or returns the records (a file that was valid before stays valid)."""
    try:
        if suffix == ".txt":
            ds = _convert(path, suffix, what)
            if _has_other_line_breaks(ds):  # str.splitlines() (the Python reader) splits there too
                raise DataError("line breaks other than \\n and \\r")
            return _arrow_table(ds, what, str(path), "text", row_map=_non_blank_rows(ds))
        return _arrow_table(_convert(path, suffix, what), what, str(path), prompt_column)
    except DataError:
        records = load_prompts(path, what, prompt_column)  # raises today's message, or reads the file
        return ListTable(records, what, str(path), eager=False)


def _convert(path: Path, suffix: str, what: str) -> Any:
    """``path`` as a memory-mapped ``Dataset``, converted once into the datasets cache."""
    ds_mod = _datasets()
    level = ds_mod.utils.logging.get_verbosity()
    ds_mod.utils.logging.set_verbosity(50)  # its own "Failed to load JSON" log lines: the DataError says it
    try:
        if suffix in (".jsonl", ".json"):
            return ds_mod.Dataset.from_json(str(path))
        if suffix == ".csv":
            return ds_mod.Dataset.from_csv(str(path))
        if suffix == ".parquet":
            return ds_mod.Dataset.from_parquet(str(path))
        return ds_mod.Dataset.from_text(str(path), encoding="utf-8-sig")  # a BOM is dropped, as read_text does
    except Exception as e:
        raise _conversion_error(path, suffix, what, e) from None
    finally:
        ds_mod.utils.logging.set_verbosity(level)


def _conversion_error(path: Path, suffix: str, what: str, e: Exception) -> DataError:
    """Name what is wrong with a file datasets could not convert: re-read here, on the error path only."""
    if suffix != ".parquet":
        read_text(path, what + ":", DataError)  # non-UTF-8: the byte offset
    if suffix == ".json":
        try:
            json.loads(read_text(path, what + ":", DataError))
        except json.JSONDecodeError as je:
            return DataError(f"{what}: {path}:{je.lineno} is not valid JSON: {je}")
    cause = e.__cause__ or e
    return DataError(f"{what}: {path} could not be read as a {suffix[1:]} table: {type(cause).__name__}: {cause}"
                     + ("; a .json file must hold a list of objects" if suffix == ".json" else ""))


def _has_other_line_breaks(ds: Any) -> bool:
    """Whether a ``.txt`` row holds a character that ``str.splitlines`` breaks lines at but datasets'
    text reader does not (form feed, vertical tab, U+2028, ...): such a file keeps the Python reader's
    rows, so its prompt order is what it always was."""
    import pyarrow.compute as pc

    pattern = "[\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]"
    return any(pc.any(pc.match_substring_regex(c, pattern)).as_py() for c in ds.data.column("text").chunks)


def _non_blank_rows(ds: Any) -> np.ndarray | None:
    """Rows of a ``.txt`` table that are not blank (what the Python reader keeps), chunk by chunk;
    None when every row is kept."""
    import pyarrow.compute as pc

    keep = [np.asarray(pc.greater(pc.utf8_length(pc.utf8_trim_whitespace(chunk)), 0).fill_null(False))
            for chunk in ds.data.column("text").chunks]
    mask = np.concatenate(keep) if keep else np.zeros(0, dtype=bool)
    return None if mask.all() else np.flatnonzero(mask)


def _load_from_disk(path: Path, split: str, what: str) -> Any:
    ds_mod = _datasets()
    try:
        ds = ds_mod.load_from_disk(str(path))
    except Exception as e:
        raise DataError(f"{what}: {path} is a folder, but not one written by datasets' save_to_disk "
                        f"({type(e).__name__}: {e})") from None
    if isinstance(ds, ds_mod.DatasetDict):
        if split not in ds:
            key = "data.eval_split" if "eval" in what else "data.split"
            raise DataError(f"{what}: {path} has no split '{split}' (it has {sorted(ds)}); set {key}")
        ds = ds[split]
    return ds


def _load_hub(name: str, subset: str | None, split: str, what: str) -> Any:
    ds_mod = _datasets()
    try:
        ds = ds_mod.load_dataset(name, subset, split=split)
    except Exception as e:
        offline = os.environ.get("HF_DATASETS_OFFLINE", os.environ.get("HF_HUB_OFFLINE", "")) not in ("", "0")
        hint = ("HF_DATASETS_OFFLINE is set, so only data sets already in the local datasets cache load; "
                "load it once on a machine online, or point data.prompts at a file"
                if offline else "is it a file path with a typo? (HF_DATASETS_OFFLINE=1 would also make "
                "this an offline lookup of the local cache)")
        raise DataError(f"{what}: '{name}' is not a file or folder, so it was taken as a data set name for "
                        f"datasets.load_dataset('{name}', {subset!r}, split='{split}'), which failed: "
                        f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}. {hint}") from None
    if not isinstance(ds, ds_mod.Dataset):  # an iterable (streaming) data set has no rows by index
        raise DataError(f"{what}: '{name}' did not load as a Dataset with rows by index ({type(ds).__name__})")
    return ds


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


def _arrow_table(ds: Any, what: str, where: str, prompt_column: str, row_map: np.ndarray | None = None
                 ) -> ArrowTable:
    """Check what is cheap on the Arrow table (the schema and the prompt column's nulls) and wrap it."""
    import pyarrow.compute as pc

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
    if chat is None:
        raise DataError(f"{what}: {where}: column '{prompt_column}' holds {ds.features['prompt']}, not strings or "
                        f"lists of chat messages ({{'role', 'content'}} objects)")
    if chat and MESSAGES_KEY in cols:
        raise DataError(f"{what}: {where} has a '{MESSAGES_KEY}' column, a name rallyrl uses for the messages "
                        f"of a conversational prompt; rename the column")
    column = ds.data.column("prompt")
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
