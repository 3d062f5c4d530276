"""Opening ``data.prompts`` / ``data.eval_prompts``: an inline list, a file, a ``save_to_disk`` folder, a
data set name or a ``datasets`` object, each as a ``PromptTable``. ``datasets`` is imported only when such
a source is used."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from ..config import read_text
from .records import DataError, load_prompts
from .tables import ListTable, PromptTable, arrow_table

# File suffixes read through datasets (beside a save_to_disk folder and a data set name).
FILE_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet", ".txt")


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
            return arrow_table(source, what, "the Dataset", prompt_column)
    if not isinstance(source, (str, Path)):
        raise DataError(f"{what}: expected a path, a data set name or a list, got {type(source).__name__}")
    path = Path(source).expanduser()
    if path.is_dir():
        return arrow_table(_load_from_disk(path, split, what), what, str(path), prompt_column)
    suffix = path.suffix.lower()
    if path.is_file():
        if suffix in (".jsonl", ".txt"):
            return _legacy_file(path, suffix, what, prompt_column)
        if suffix not in FILE_SUFFIXES:
            raise DataError(f"{what}: {path} must be a .jsonl, .json, .csv, .parquet or .txt file, a folder "
                            f"written by datasets' save_to_disk, or a data set name")
        return arrow_table(_convert(path, suffix, what), what, str(path), prompt_column)
    s = str(source)
    if suffix in FILE_SUFFIXES or s.startswith((".", "/", "~")) or os.sep + os.sep in s or s.count("/") > 1:
        raise DataError(f"{what}: file not found: {path}")
    return arrow_table(_load_hub(s, subset, split, what), what, s, prompt_column)


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
            return arrow_table(ds, what, str(path), "text", row_map=_non_blank_rows(ds))
        return arrow_table(_convert(path, suffix, what), what, str(path), prompt_column)
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
