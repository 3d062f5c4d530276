"""Run-directory writers: metrics.jsonl, rollouts.jsonl, eval samples, optional TensorBoard.

Only the main rank writes (one writer per file, so lines never interleave). Files are opened in append
mode and flushed per line, so a killed run keeps every completed iteration.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/inf; keep the information as text
    return v


class RunWriter:
    def __init__(self, run_dir: Path, tensorboard: bool) -> None:
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        self._metrics = open(run_dir / "metrics.jsonl", "a", encoding="utf-8")
        self._rollouts = open(run_dir / "rollouts.jsonl", "a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:  # tensorboard is an optional dependency
                raise RuntimeError(
                    "train.tensorboard=true needs the tensorboard package: pip install 'rallyrl[tensorboard]'"
                ) from e
            self._tb = SummaryWriter(str(run_dir / "tensorboard"))

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, **{k: _clean(v) for k, v in sorted(metrics.items())}}
        self._metrics.write(json.dumps(row) + "\n")
        self._metrics.flush()
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()

    def log_rollouts(self, records: list[dict[str, Any]]) -> None:
        for r in records:
            self._rollouts.write(json.dumps(r, ensure_ascii=False) + "\n")
        self._rollouts.flush()

    def log_eval_samples(self, step: int, records: list[dict[str, Any]]) -> None:
        d = self.run_dir / "eval"
        d.mkdir(exist_ok=True)
        with open(d / f"step_{step}.jsonl", "w", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")

    def close(self) -> None:
        self._metrics.close()
        self._rollouts.close()
        if self._tb is not None:
            self._tb.close()


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
