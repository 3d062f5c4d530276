"""The run's JSONL logs, read and written in this one place.

Files (the run-directory contract, DESIGN.md): ``metrics.jsonl`` (one strict-JSON object per iteration:
``step`` plus metrics; a non-finite value is written as ``null``), ``rollouts.jsonl`` (one line per
sample), ``eval/step_<N>.jsonl`` (the evaluation's samples) and ``config_history.jsonl`` (what each
resume changed). Only the main rank writes (one writer per file, so lines never interleave); files are
opened in append mode and flushed per line, so a killed run keeps every completed iteration.

Every line is one JSON document on exactly one line, and readers split on ``"\\n"`` only: sampled text
may hold line breaks that ``str.splitlines()`` would split on (U+0085, U+2028, U+2029), so those are
written escaped. A last line without its newline is one still being written (a live run, or one killed
mid-write): readers that may meet one (``plot``, resume's truncation) leave it out.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from .. import trackers
from ..config import Config, flat_config
from ..errors import writing

if TYPE_CHECKING:
    from ..trackers import Tracker

__all__ = ["JsonlError", "MetricsFile", "RunWriter", "append_jsonl", "clean", "has_iteration", "iter_jsonl",
           "jsonl_line", "last_step", "read_jsonl", "truncate_jsonl"]


# --------------------------------------------------------------------------------------------------
# reading


class JsonlError(ValueError):
    """A line of a JSONL file is not valid JSON; ``path`` and ``lineno`` say which."""

    def __init__(self, path: Path, lineno: int, error: json.JSONDecodeError) -> None:
        super().__init__(f"{path}:{lineno} is not valid JSON: {error}")
        self.path, self.lineno, self.error = path, lineno, error


def _lines(path: Path, complete_only: bool) -> list[str]:
    text = Path(path).read_text(encoding="utf-8")
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the newline that ends the last line
    elif complete_only and lines:
        lines.pop()  # a line still being written (a live or killed run): not a row yet
    return lines


def iter_jsonl(path: str | Path, complete_only: bool = False) -> Iterator[tuple[int, Any]]:
    """``(line number, value)`` for each non-blank line of ``path`` (numbered from 1). ``complete_only``:
    leave out a last line that has no newline yet. A line that is not JSON raises ``JsonlError``."""
    for lineno, line in enumerate(_lines(Path(path), complete_only), 1):
        if not line.strip():
            continue
        try:
            yield lineno, json.loads(line)
        except json.JSONDecodeError as e:
            raise JsonlError(Path(path), lineno, e) from None


def read_jsonl(path: str | Path) -> list[Any]:
    """Every row of a JSONL file (blank lines skipped; a line that is not JSON raises ``JsonlError``)."""
    return [row for _, row in iter_jsonl(path)]


def has_iteration(metrics: Path) -> bool:
    """True if ``metrics.jsonl`` records a completed iteration (a row with ``step >= 1``); a line that
    is not rallyrl's JSON counts as one (not ours to judge: the folder is treated as holding a run)."""
    if not metrics.is_file():
        return False
    for line in _lines(metrics, complete_only=False):
        try:
            if line.strip() and json.loads(line).get("step", 0) >= 1:
                return True
        except json.JSONDecodeError:
            return True
    return False


def last_step(metrics: Path) -> int:
    """The last iteration ``metrics.jsonl`` records (0: none, or not a file rallyrl can read)."""
    if not metrics.is_file():
        return 0
    steps = [0]
    for line in _lines(metrics, complete_only=True):
        try:
            row = json.loads(line) if line.strip() else {}
        except json.JSONDecodeError:
            continue
        step = row.get("step") if isinstance(row, dict) else None
        if isinstance(step, int) and not isinstance(step, bool):
            steps.append(step)
    return max(steps)


# --------------------------------------------------------------------------------------------------
# writing


def clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None  # strict JSON has no NaN/inf: a non-finite value is written as null
    if isinstance(v, dict):  # an episode's transcript (a tool's arguments may hold anything JSON parses)
        return {k: clean(x) for k, x in v.items()}
    if isinstance(v, list):
        return [clean(x) for x in v]
    return v


# Line breaks that json.dumps(ensure_ascii=False) leaves raw inside strings, but str.splitlines() (and
# so most readers) splits on: sampled text can contain them.
_RAW_BREAKS = {"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"}


def episode_records(rows: list[dict[str, Any]], transcripts: list[dict[str, Any] | None]) -> list[dict[str, Any]]:
    """Multi-turn episodes: one record per EPISODE from its rows' records (several after a fork): the
    episode's reward (summed over its rows), its first row's advantage, its KL (summed), and its
    transcript under ``episode`` (each turn's text, token counts, tool calls with results, the
    environment's messages and reward; ``truncated``, ``forks``)."""
    out: list[dict[str, Any]] = []
    for rec, t in zip(rows, transcripts):
        if out and out[-1]["index"] == rec["index"] and "episode" not in out[-1]:  # a later row of the same episode
            prev = out[-1]
            prev["reward"] += rec["reward"]
            prev["kl"] = None if prev["kl"] is None else prev["kl"] + rec["kl"]
        else:
            out.append(dict(rec))
        if t is not None:  # the episode's last row carries its transcript
            out[-1]["episode"] = {
                "turns": [{k: v for k, v in turn.items() if k != "token_ids"} for turn in t["turns"]],
                "truncated": t["truncated"], "forks": t["forks"]}
    return out


def jsonl_line(obj: Any, strict: bool = False) -> str:
    """``obj`` as exactly one JSONL line (text kept readable, not \\u-escaped), whatever ``splitlines``
    variant reads it back. ``strict``: non-finite floats (at the top level) are written as ``null``."""
    if strict:
        obj = {k: clean(v) for k, v in obj.items()}
    dumped = json.dumps(obj, ensure_ascii=False, allow_nan=not strict)
    for raw, esc in _RAW_BREAKS.items():
        dumped = dumped.replace(raw, esc)
    return dumped + "\n"


def append_jsonl(path: Path, obj: Any) -> None:
    """One row appended to ``path`` (``config_history.jsonl``)."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(obj) + "\n")


def truncate_jsonl(path: Path, last_step: int) -> None:
    """Keep the rows of ``path`` up to ``last_step`` (resume: a killed run may have logged iterations
    after its last checkpoint), atomically (a temporary file, then ``os.replace``). A last line without
    its newline was torn by the kill and is after the checkpoint: it goes too."""
    keep = [line + "\n" for line in _lines(path, complete_only=True)
            if line.strip() and json.loads(line)["step"] <= last_step]
    tmp = path.with_suffix(path.suffix + ".tmp")
    with writing(tmp, "resuming the logs"):
        tmp.write_text("".join(keep), encoding="utf-8")
        os.replace(tmp, path)


class MetricsFile:
    """``metrics.jsonl`` as a ``Tracker`` (``rallyrl.trackers``): one strict-JSON line per iteration
    (non-finite values as ``null``), flushed per line. Always on; the other trackers come from
    ``train.report_to``."""

    def __init__(self, path: Path) -> None:
        self._f = open(path, "a", encoding="utf-8")

    def start(self, config: dict[str, Any]) -> None:
        pass  # the config is config.yaml

    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, **{k: clean(v) for k, v in sorted(metrics.items())}}
        self._f.write(json.dumps(row, allow_nan=False) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


class Claims(Protocol):
    """What the writer needs of the run directory (``run.rundir.RunDir``): its path, and ``claim`` (a
    file or folder recorded in the manifest as rallyrl's own before it is written)."""

    path: Path

    def claim(self, rel: str, is_dir: bool = False) -> Path: ...


class RunWriter:
    """The main rank's log files and trackers. Every write of rallyrl's own files goes through
    ``errors.writing``: a full disk or a permission problem is one line naming the file, not a traceback."""

    def __init__(self, run_dir: Claims, cfg: Config, resuming: bool = False) -> None:
        self.run_dir = run_dir
        self._rollouts = open(run_dir.claim("rollouts.jsonl"), "a", encoding="utf-8")
        state = trackers.TrackerState(run_dir.path / trackers.STATE_FILE, resuming, run_dir.claim)
        self._metrics = MetricsFile(run_dir.claim("metrics.jsonl"))
        self.trackers: list[Tracker] = [self._metrics]
        self.trackers += trackers.create(trackers.chosen(cfg), cfg, state,
                                         lambda: run_dir.claim("tensorboard", is_dir=True))
        self._started: list[Tracker] = []

    def start(self, cfg: Config) -> None:
        """Start every tracker (a failure propagates: ``RunDir.open`` stops every rank with it)."""
        flat = flat_config(cfg)
        for t in self.trackers:
            t.start(flat)
            self._started.append(t)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        with writing(self.run_dir.path / "metrics.jsonl", "logging metrics"):
            self._metrics.log(step, metrics)
        for t in [t for t in self._started if t is not self._metrics]:
            try:
                t.log(step, metrics)
            except Exception as e:
                # A tracker that fails mid-run (a lost server) must not stop training, and only this
                # rank would see it: it is dropped with one line; metrics.jsonl has every iteration.
                self._started.remove(t)
                print(f"rallyrl: warning: {type(t).__name__.lower()} failed at iteration {step} ({type(e).__name__}: "
                      f"{e}); it logs nothing more in this run (metrics.jsonl has every iteration)", file=sys.stderr)

    def log_rollouts(self, records: list[dict[str, Any]]) -> None:
        with writing(self._rollouts.name, "logging rollouts"):
            for r in records:
                self._rollouts.write(jsonl_line(r, strict=True))
            self._rollouts.flush()

    def log_eval_samples(self, step: int, records: list[dict[str, Any]]) -> None:
        path = self.run_dir.path / f"eval/step_{step}.jsonl"
        with writing(path, "logging eval samples"):
            if not (self.run_dir.path / "eval").exists():
                self.run_dir.claim("eval", is_dir=True)
            with open(self.run_dir.claim(f"eval/step_{step}.jsonl"), "w", encoding="utf-8") as f:
                for r in records:
                    f.write(jsonl_line(r))

    def close(self) -> None:
        with writing(self.run_dir.path, "closing the logs"):
            self._rollouts.close()
            self._metrics.close()
        for t in self._started:
            if t is not self._metrics:
                try:
                    t.close()
                except Exception as e:  # the run's outcome stands; the tracker's last words are a warning
                    print(f"rallyrl: warning: closing {type(t).__name__.lower()} failed ({type(e).__name__}: {e})",
                          file=sys.stderr)
        self._started = []
