"""What ``train()`` returns (``TrainResult``): its own module, imported by the console that fills it and
by the stage that writes it into the model card, so neither imports the other."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class TrainResult:
    run_dir: Path
    metrics: list[dict[str, float]] = field(default_factory=list)  # one dict per iteration (main rank)
    eval_before: dict[str, float] = field(default_factory=dict)  # eval/* before the first iteration
    eval_after: dict[str, float] = field(default_factory=dict)  # eval/* of the latest evaluation
    iterations: int = 0  # the last completed iteration (also after a resume)
    stopped_by: str | None = None  # "EarlyStop.on_iteration" when a callback ended the run early
