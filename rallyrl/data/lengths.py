"""The token length of every prompt of a set, computed once and cached (``data.long_prompts: error``
checks every row at start; ``rallyrl check`` reports the longest).

The lengths are what the run itself computes for a row (rendered with the chat template, tokenized with
the run's special-token rule, by ``PromptSet``'s own loader), so the index can never disagree with a
draw. Cached as a ``.npy`` of int32 (4 bytes a row) under a name that hashes everything the lengths
depend on: the table (datasets' fingerprint, its Arrow files' paths, sizes and modification times, the
row map of a ``.txt``), the tokenizer (its full serialisation, special tokens and settings) and the chat
template. A changed file, tokenizer or template gives another name, so a stale index is never read.

Where: beside the table's Arrow files when they are in the datasets cache (a converted file, a data set
name); otherwise (a ``save_to_disk`` folder, a ``.jsonl`` read by the Python reader) in
``$HF_DATASETS_CACHE/rallyrl_prompt_lengths/``: rallyrl never writes into a user's data folder. A
table held only in memory (a ``Dataset`` built in the process) is scanned each time. Concurrent
starts (every rank of a ``torchrun`` job) take a file lock: one builds, the others read its result.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .tables import ArrowTable, ListTable, PromptTable

VERSION = 1  # of the index format and of what a length means; a change here invalidates every index
BLOCK = 8192  # rows rendered and tokenized per batch


def cached_lengths(table: PromptTable, tokenizer: Any, count: Callable[[list[int]], Sequence[int]],
                   label: str) -> np.ndarray:
    """The token length of every row of ``table`` (``count(rows)`` gives the lengths of some rows): read
    from the index when there is one for this table, tokenizer and template, else computed (with
    progress on stderr) and saved. ``label`` names the set in the progress lines."""
    place = _index_path(table, tokenizer)
    if place is None:
        return scan(len(table), count, label)
    found = _read(place, len(table))
    if found is not None:
        return found
    from filelock import FileLock  # a dependency of datasets and huggingface_hub

    place.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(place) + ".lock"):
        found = _read(place, len(table))  # another process built it while this one waited
        if found is not None:
            return found
        lengths = scan(len(table), count, label)
        tmp = place.with_name(f"{place.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            np.save(f, lengths)
        os.replace(tmp, place)  # readers see the whole index or none
    say(f"rallyrl: prompt lengths of {label} cached in {place}")
    return lengths


def scan(n: int, count: Callable[[list[int]], Sequence[int]], label: str) -> np.ndarray:
    """Every row's length, block by block; progress on stderr (a bar on a terminal, else a line at the
    start and at the end), only on the main process."""
    out = np.empty(n, dtype=np.int32)
    t0 = time.perf_counter()
    bar = _progress(n, label)
    for lo in range(0, n, BLOCK):
        hi = min(n, lo + BLOCK)
        out[lo:hi] = count(list(range(lo, hi)))
        if bar is not None:
            bar.update(hi - lo)
    if bar is not None:
        bar.close()
    if n > BLOCK:
        say(f"rallyrl: measured the token length of {n:,} prompts of {label} in {time.perf_counter() - t0:.1f} s")
    return out


def _progress(n: int, label: str) -> Any:
    if n <= BLOCK or not main_process():
        return None
    if not sys.stderr.isatty():
        say(f"rallyrl: measuring the token length of {n:,} prompts of {label} (once; then cached)")
        return None
    from tqdm.auto import tqdm  # a dependency of transformers and datasets

    return tqdm(total=n, desc=f"rallyrl: prompt lengths of {label}", unit=" prompts", file=sys.stderr,
                mininterval=1.0, leave=False)


def main_process() -> bool:
    # The launcher's RANK, as rallyrl.dist.expected_rank reads it (data/ does not import torch).
    return os.environ.get("RANK", "0") == "0"


def say(line: str) -> None:
    if main_process():
        print(line, file=sys.stderr, flush=True)


def _read(path: Path, n: int) -> np.ndarray | None:
    try:
        lengths = np.load(path, allow_pickle=False)
    except (OSError, ValueError):  # absent, or a partial / foreign file: rebuilt
        return None
    return lengths if lengths.shape == (n,) and lengths.dtype == np.int32 else None


def _index_path(table: PromptTable, tokenizer: Any) -> Path | None:
    """Where the index of ``table`` with ``tokenizer`` lives; None for a table with no file behind it."""
    files = _files(table)
    if not files:
        return None
    import datasets

    cache = Path(datasets.config.HF_DATASETS_CACHE).resolve()
    first = Path(files[0]).resolve()
    folder = first.parent if cache in first.parents else cache / "rallyrl_prompt_lengths"
    h = hashlib.sha256(json.dumps(_table_identity(table, files), sort_keys=True).encode())
    h.update(tokenizer_identity(tokenizer).encode())
    return folder / f"rallyrl-prompt-lengths-{h.hexdigest()[:24]}.npy"


def _files(table: PromptTable) -> list[str]:
    if isinstance(table, ArrowTable):
        return [f["filename"] for f in table._ds.cache_files]
    if isinstance(table, ListTable) and table.where != "the list" and Path(table.where).is_file():
        return [table.where]  # a .jsonl / .txt the Python reader read
    return []


def _table_identity(table: PromptTable, files: list[str]) -> dict[str, Any]:
    stats = [(str(Path(f).resolve()), os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in files]
    out: dict[str, Any] = {"version": VERSION, "files": stats, "rows": len(table), "chat": table.chat}
    if isinstance(table, ArrowTable):
        out["fingerprint"] = table._ds._fingerprint
        if table._map is not None:
            out["row_map"] = hashlib.sha256(np.ascontiguousarray(table._map).tobytes()).hexdigest()
    return out


def tokenizer_identity(tokenizer: Any) -> str:
    """A digest of everything a prompt's token count depends on in the tokenizer: its full serialisation
    (a fast tokenizer's ``tokenizer.json``: vocabulary, merges, normaliser, pre-tokeniser and the
    post-processor that adds special tokens; a slow one's vocabulary), its special tokens and settings,
    and its chat template."""
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    settings = {k: v for k, v in getattr(tokenizer, "init_kwargs", {}).items() if k != "name_or_path"}
    for part in (tokenizer.special_tokens_map, settings, getattr(tokenizer, "chat_template", None)):
        h.update(json.dumps(part, sort_keys=True, default=str).encode())
    return h.hexdigest()
