"""Opening ``data.prompts`` / ``data.eval_prompts``: an inline list, a file, a ``save_to_disk`` folder, a
data set name or a ``datasets`` object, each as a ``PromptTable``. ``datasets`` is imported only when such
a source is used."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

import numpy as np

from ..config import read_text
from .records import DataError, load_prompts
from .tables import ListTable, PromptTable, arrow_table

# File suffixes read through datasets (beside a save_to_disk folder and a data set name).
FILE_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet", ".txt")


if TYPE_CHECKING:  # only for the type hint: datasets is imported when a file or data set is used
    import datasets

# What ``train(prompts=..., eval_prompts=...)`` takes (``data.prompts`` in a config: a path, a name or a list).
PromptSource = Union[str, "os.PathLike[str]", Sequence[Any], "datasets.Dataset", "datasets.DatasetDict"]

# What data.prompts / data.eval_prompts / train(prompts=...) accept, for the message that refuses anything else.
ACCEPTED = ("a path (a .jsonl, .json, .csv, .parquet or .txt file, or a folder written by datasets' save_to_disk), "
            "a data set name, a list of prompts, or a datasets.Dataset / DatasetDict")


def open_prompts(source: PromptSource, what: str = "data.prompts", prompt_column: str = "prompt",
                 split: str = "train", subset: str | None = None) -> PromptTable:
    """The prompt store of ``data.prompts`` / ``data.eval_prompts`` (``what`` names it in errors); the
    Python API may also pass a ``datasets.Dataset`` / ``DatasetDict``.

    An inline list: Python records, every row checked now (``load_prompts``). A file (``.jsonl``,
    ``.json`` holding a list of objects, ``.csv``, ``.parquet``, ``.txt``), a folder written by
    ``save_to_disk`` (a ``DatasetDict``: its ``split``) or a data set name for ``datasets.load_dataset``
    (``subset``, ``split``): an Arrow table, with what is cheap checked now (rows exist, the prompt column
    exists and holds strings or chat messages, no row lacks a prompt, the file parses and is UTF-8); what
    needs the tokenizer is checked when a row is drawn. A ``.jsonl``/``.txt`` has the rows it had before
    (blank lines skipped), so the shared prompt order is unchanged. A source with no rows is a
    ``DataError`` saying "no prompts in ..." (or naming the empty split or column)."""
    if isinstance(source, list):
        return ListTable(load_prompts(source, what, prompt_column), what)
    if not isinstance(source, (str, Path)):
        return _open_object(source, what, prompt_column, split)
    path = Path(source).expanduser()
    if path.is_dir():
        ds, where = _load_from_disk(path, split, what)
        return arrow_table(ds, what, where, prompt_column)
    suffix = path.suffix.lower()
    if path.is_file():
        if suffix in (".jsonl", ".txt"):
            return _legacy_file(path, suffix, what, prompt_column)
        if suffix not in FILE_SUFFIXES:
            raise DataError(f"{what}: {path} must be a .jsonl, .json, .csv, .parquet or .txt file, a folder "
                            f"written by datasets' save_to_disk, or a data set name")
        if path.stat().st_size == 0:  # what datasets would say ("BatchSize", "no data") names no cause
            raise DataError(f"{what}: no prompts in {path} (the file is empty)")
        return arrow_table(_convert(path, suffix, what), what, str(path), prompt_column)
    s = str(source)
    if suffix in FILE_SUFFIXES or s.startswith((".", "/", "~")) or os.sep + os.sep in s or s.count("/") > 1:
        raise DataError(f"{what}: file not found: {path}")
    return arrow_table(_load_hub(s, subset, split, what), what, s, prompt_column)


def _open_object(source: Any, what: str, prompt_column: str, split: str) -> PromptTable:
    """``train(prompts=...)`` given an object: a ``datasets.Dataset`` or ``DatasetDict`` (as TRL takes
    them); a streaming data set, a pandas DataFrame or anything else is refused saying what is accepted."""
    kind = type(source).__name__
    if type(source).__module__.split(".")[0] == "datasets":
        ds_mod = _datasets()
        if isinstance(source, ds_mod.DatasetDict):
            if not source:
                raise DataError(f"{what}: no prompts in the DatasetDict (it has no splits)")
            if split not in source:
                key = "data.eval_split" if "eval" in what else "data.split"
                raise DataError(f"{what}: the DatasetDict has no split '{split}' (it has {sorted(source)}); set {key}")
            return arrow_table(source[split], what, f"split '{split}' of the DatasetDict", prompt_column)
        if isinstance(source, ds_mod.Dataset):
            return arrow_table(source, what, "the Dataset", prompt_column)
        if isinstance(source, (ds_mod.IterableDataset, ds_mod.IterableDatasetDict)):
            raise DataError(f"{what}: got a datasets.{kind} (a streaming data set), which has no rows by index; "
                            f"rallyrl draws prompts by row index (the shared prompt order, resumed exactly), so "
                            f"pass a datasets.Dataset instead (load_dataset(..., streaming=False), or "
                            f"Dataset.from_generator). Accepted: {ACCEPTED}")
    if type(source).__module__.split(".")[0] == "pandas" and kind == "DataFrame":
        raise DataError(f"{what}: got a pandas DataFrame; pass datasets.Dataset.from_pandas(df) (or "
                        f"df.to_dict('records')). Accepted: {ACCEPTED}")
    raise DataError(f"{what}: expected {ACCEPTED}, got {kind}")


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
    if suffix == ".parquet":
        return _empty_parquet(path, what) or _cannot_read(path, suffix, what, e)
    text = read_text(path, what + ":", DataError)  # non-UTF-8: the byte offset
    if suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as je:
            return DataError(f"{what}: {path}:{je.lineno} is not valid JSON: {je}")
        if data in ([], {}):  # datasets: 'Instruction "train" corresponds to no data!'
            return DataError(f"{what}: no prompts in {path} (it holds {json.dumps(data)})")
    if suffix == ".csv":
        import csv
        import io

        if sum(1 for row in csv.reader(io.StringIO(text)) if any(c.strip() for c in row)) <= 1:
            return DataError(f"{what}: no prompts in {path} (a header row only)")
    return _cannot_read(path, suffix, what, e)


def _empty_parquet(path: Path, what: str) -> DataError | None:
    """A ``.parquet`` with no rows (datasets: "BatchSize must be greater than 0"); None otherwise."""
    import pyarrow.parquet as pq

    try:
        rows = pq.ParquetFile(str(path)).metadata.num_rows
    except Exception:  # not a parquet file at all: the conversion's own error says so
        return None
    return DataError(f"{what}: no prompts in {path} (0 rows)") if rows == 0 else None


def _cannot_read(path: Path, suffix: str, what: str, e: Exception) -> DataError:
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


def _load_from_disk(path: Path, split: str, what: str) -> tuple[Any, str]:
    """A ``save_to_disk`` folder: the ``Dataset``, or the ``split`` of a ``DatasetDict`` (only that split is
    read, so another split being empty or broken does not matter), and how messages name it."""
    ds_mod = _datasets()
    where, folder = str(path), path
    if not any(path.iterdir()):
        raise DataError(f"{what}: no prompts in {path} (an empty folder)")
    splits_file = path / "dataset_dict.json"  # what DatasetDict.save_to_disk writes beside its split folders
    if splits_file.is_file():
        try:
            splits = list(json.loads(splits_file.read_text())["splits"])
        except (ValueError, KeyError, TypeError, OSError):
            splits = None  # not datasets' file after all: load_from_disk below says what is wrong
        if splits is not None:
            if split not in splits:
                key = "data.eval_split" if "eval" in what else "data.split"
                raise DataError(f"{what}: {path} has no split '{split}' (it has {sorted(splits)}); set {key}")
            where, folder = f"split '{split}' of {path}", path / split
    if _saved_without_rows(folder):  # datasets itself fails on it with an IndexError
        raise DataError(f"{what}: no prompts in {where}")
    try:
        ds = ds_mod.load_from_disk(str(folder))
    except Exception as e:
        raise DataError(f"{what}: {path} is a folder, but not one written by datasets' save_to_disk "
                        f"({type(e).__name__}: {e})") from None
    if isinstance(ds, ds_mod.DatasetDict):  # not reached for datasets' own layout; kept for safety
        if split not in ds:
            key = "data.eval_split" if "eval" in what else "data.split"
            raise DataError(f"{what}: {path} has no split '{split}' (it has {sorted(ds)}); set {key}")
        ds, where = ds[split], f"split '{split}' of {path}"
    return ds, where


def _saved_without_rows(folder: Path) -> bool:
    """Whether ``folder`` holds a ``Dataset`` saved by ``save_to_disk`` with no rows (no data files)."""
    try:
        return json.loads((folder / "state.json").read_text()).get("_data_files") == []
    except (OSError, ValueError, AttributeError):
        return False


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
    if not len(ds):
        raise DataError(f"{what}: no prompts in split '{split}' of {name}")
    return ds
