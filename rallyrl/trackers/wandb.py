"""Weights & Biases (``train.report_to: [wandb]``; the ``wandb`` extra)."""

from __future__ import annotations

import os
import secrets
from typing import Any

from ..config import Config
from .common import TrackerState, exit_status, param_values, project_name, run_name, scalars


class Wandb:
    """``wandb.init(project, name, id, resume="allow", config)``; ``WANDB_MODE=offline`` etc. apply."""

    def __init__(self, cfg: Config, state: TrackerState) -> None:
        self.cfg, self.state = cfg, state
        self.run: Any = None

    def start(self, config: dict[str, Any]) -> None:
        import wandb

        # The id is chosen and kept before wandb.init: a run killed at any point resumes the same run.
        run_id = self.state.get("wandb").get("id") or os.environ.get("WANDB_RUN_ID") or secrets.token_hex(4)
        self.state.set("wandb", {"id": run_id})
        # WANDB_DIR and WANDB_MODE are read per run: wandb keeps the first run's in a process-wide
        # singleton, so a second train() in one process (a sweep, a test) would otherwise ignore changes.
        mode = os.environ.get("WANDB_MODE")
        self.run = wandb.init(project=project_name(self.cfg, "WANDB_PROJECT"), name=run_name(self.cfg, "WANDB_NAME"),
                              id=run_id, resume="allow", config=param_values(config), dir=os.environ.get("WANDB_DIR"),
                              mode=mode if mode in ("online", "offline", "disabled", "shared") else None)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        # wandb refuses steps below the run's current one: after a resume, the iterations between the
        # checkpoint and the kill are already there (with the same values: resume is bit-exact).
        if step >= (getattr(self.run, "step", 0) or 0):
            self.run.log(scalars(metrics), step=step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish(exit_code=0 if exit_status() == "finished" else 1)
            self.run = None
