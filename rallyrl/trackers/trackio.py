"""Trackio (``train.report_to: [trackio]``; the ``trackio`` extra)."""

from __future__ import annotations

from typing import Any

from ..config import Config
from .common import TrackerState, param_values, project_name, run_name, scalars


class Trackio:
    """``trackio.init(project, name, config, resume)``; its local store is ``TRACKIO_DIR`` (default
    ``~/.cache/huggingface/trackio``); ``TRACKIO_SPACE_ID`` sends it to a Space."""

    def __init__(self, cfg: Config, state: TrackerState) -> None:
        self.cfg, self.state = cfg, state
        self.run: Any = None

    def start(self, config: dict[str, Any]) -> None:
        import trackio

        kept = self.state.get("trackio")
        project = kept.get("project") or project_name(self.cfg, "TRACKIO_PROJECT")
        name = kept.get("name") or run_name(self.cfg)
        self.run = trackio.init(project=project, name=name, config=param_values(config),
                                resume="allow" if kept else "never")
        self.state.set("trackio", {"project": project, "name": self.run.name})

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.run.log(scalars(metrics), step=step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
