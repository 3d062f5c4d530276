"""TensorBoard (``train.report_to: [tensorboard]`` or ``train.tensorboard: true``): event files in
``run_dir/tensorboard/`` (a resume appends to the folder)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config import Config
from .common import scalars


class TensorBoard:
    def __init__(self, cfg: Config, folder: Path) -> None:
        self.folder = folder
        self._w: Any = None

    def start(self, config: dict[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._w = SummaryWriter(str(self.folder))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        for k, v in scalars(metrics).items():
            self._w.add_scalar(k, v, step)
        self._w.flush()

    def close(self) -> None:
        if self._w is not None:
            self._w.close()
            self._w = None
