"""What every tracker shares: how the config becomes parameters, which metrics can be plotted, the
project and run names, how the run ended, and ``run_dir/trackers.json`` (what a resume needs to
continue the same tracker runs)."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from ..config import Config

STATE_FILE = "trackers.json"  # ids that let a resumed run continue the same tracker runs
_MAX_PARAM_CHARS = 500  # a longer config value (an inline prompt list) is shortened


def param_values(flat: dict[str, Any]) -> dict[str, Any]:
    """Config values as trackers store parameters: scalars as they are, lists and mappings as JSON, any
    value longer than 500 characters shortened (an inline prompt list can be megabytes)."""
    out = {}
    for k, v in flat.items():
        if isinstance(v, (list, dict)):
            v = json.dumps(v, ensure_ascii=False)
        if isinstance(v, str) and len(v) > _MAX_PARAM_CHARS:
            v = v[: _MAX_PARAM_CHARS - 3] + "..."
        out[k] = v
    return out


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of a metrics row (what a tracker can plot)."""
    return {k: float(v) for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def exit_status() -> str:
    """How the run is ending, seen from ``close()`` (called in the trainer's ``finally``)."""
    exc = sys.exc_info()[0]
    if exc is None:
        return "finished"
    return "killed" if issubclass(exc, KeyboardInterrupt) else "failed"


class TrackerState:
    """``run_dir/trackers.json``: per tracker, what resuming its run needs (written through at once)."""

    def __init__(self, path: Path, resuming: bool, claim: Any) -> None:
        self.path, self._claim = path, claim
        self.data: dict[str, dict[str, Any]] = {}
        if resuming and path.is_file():
            try:
                self.data = json.loads(path.read_text(encoding="utf-8"))
            except json.JSONDecodeError:
                self.data = {}  # a torn write: the trackers start new runs

    def get(self, name: str) -> dict[str, Any]:
        return dict(self.data.get(name, {}))

    def set(self, name: str, value: dict[str, Any]) -> None:
        self.data[name] = value
        self._claim(STATE_FILE).write_text(json.dumps(self.data, indent=1), encoding="utf-8")


def project_name(cfg: Config, env: str) -> str:
    return cfg.train.project or os.environ.get(env) or "rallyrl"


def run_name(cfg: Config, env: str | None = None) -> str:
    return cfg.train.run_name or (os.environ.get(env) if env else None) or Path(cfg.train.run_dir).resolve().name
