"""The experiment trackers of ``train.report_to``: TensorBoard, Weights & Biases, MLflow, Trackio.

Each implements the ``Tracker`` protocol below (``start(config)``, ``log(step, metrics)``, ``close()``),
in a module of its own (``tensorboard``, ``wandb``, ``mlflow``, ``trackio``), runs on the main rank only
and imports its package only when chosen (each is an extra: ``pip install 'rallyrl[wandb]'``).
``metrics.jsonl`` is a tracker too, always on (``rallyrl.run.logs.MetricsFile``). What each does with
rallyrl's settings:

- the config is logged as the run's parameters, flattened (``ppo.lr``), long values shortened;
- each iteration's metrics go at step = iteration (eval before training at step 0); non-finite values
  are left out (``metrics.jsonl`` keeps them, as ``null``);
- project and run name: ``train.project`` / ``train.run_name``, else the tracker's own environment
  variable (``WANDB_PROJECT``, ``WANDB_NAME``, ``MLFLOW_EXPERIMENT_NAME``, ``TRACKIO_PROJECT``), else
  ``rallyrl`` and the run directory's name. Every other variable of a tracker (``WANDB_MODE``,
  ``WANDB_DIR``, ``MLFLOW_TRACKING_URI``, ``TRACKIO_DIR``, ...) is the tracker's own business;
- a resumed run continues the same tracker run: the W&B run id, the MLflow run id and the Trackio run
  name are kept in ``run_dir/trackers.json`` (TensorBoard appends to its folder).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable
from typing import Any, Protocol

from ..config import TRACKERS, Config, ConfigError
from .common import STATE_FILE, TrackerState, param_values, scalars

__all__ = ["PACKAGES", "STATE_FILE", "Tracker", "TrackerState", "check", "check_installed", "chosen", "create",
           "param_values", "scalars"]

# tracker -> (the module it needs, the extra that installs it)
PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
            "mlflow": ("mlflow", "mlflow"), "trackio": ("trackio", "trackio")}


class Tracker(Protocol):
    """Where the config and each iteration's metrics go (main rank only)."""

    def start(self, config: dict[str, Any]) -> None:
        """Begin (or, on a resume, continue) the run; ``config`` is flat: ``{"ppo.lr": 1e-05, ...}``."""

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """One iteration's metrics (step 0: the evaluation before training)."""

    def close(self) -> None: ...


def chosen(cfg: Config) -> list[str]:
    """The trackers a config asks for, in ``TRACKERS`` order (``train.tensorboard: true`` is
    ``report_to: [tensorboard]``)."""
    names = cfg.train.report_to
    names = {names} if isinstance(names, str) else set(names)
    if cfg.train.tensorboard:
        names.add("tensorboard")
    return [n for n in TRACKERS if n in names]


def check_installed(cfg: Config) -> None:
    """A chosen tracker whose package is missing is a config error naming the extra (checked before
    anything heavy, on every rank and in the launcher's preflight)."""
    for name in chosen(cfg):
        module, extra = PACKAGES[name]
        if importlib.util.find_spec(module) is None:
            key = "train.tensorboard=true" if name == "tensorboard" and cfg.train.tensorboard else \
                f"train.report_to: {name}"
            raise ConfigError(f"{key} needs the {module} package: pip install 'rallyrl[{extra}]'")


def check(cfg: Config, reach: bool = False) -> list[str]:
    """What can be verified of the chosen trackers without starting a run: each one's package, and W&B's
    mode and login (a ``ConfigError`` naming the fix); with ``reach`` (``rallyrl check``), also MLflow's
    tracking URI (a local store's folder can be written, a server answers). One line per tracker."""
    check_installed(cfg)
    lines = []
    for name in chosen(cfg):
        if name == "wandb":
            from .wandb import check as check_wandb

            lines.append(check_wandb(cfg))
        elif name == "mlflow" and reach:
            from .mlflow import check as check_mlflow

            lines.append(check_mlflow(reach))
        else:
            lines.append(f"{name}: installed")
    return lines


def create(names: Iterable[str], cfg: Config, state: TrackerState, tensorboard_dir: Any) -> list[Any]:
    """The trackers ``names`` (not started). ``tensorboard_dir()`` claims the run dir's ``tensorboard/``."""
    made: list[Any] = []
    for name in names:  # each module imported only when chosen (its package is imported on start())
        if name == "tensorboard":
            from .tensorboard import TensorBoard

            made.append(TensorBoard(cfg, tensorboard_dir()))
        elif name == "wandb":
            from .wandb import Wandb

            made.append(Wandb(cfg, state))
        elif name == "mlflow":
            from .mlflow import Mlflow

            made.append(Mlflow(cfg, state))
        elif name == "trackio":
            from .trackio import Trackio

            made.append(Trackio(cfg, state))
    return made
