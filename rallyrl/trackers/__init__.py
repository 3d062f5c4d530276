"""The experiment trackers of ``train.report_to``: TensorBoard, Weights & Biases, MLflow, Trackio.

Each implements the ``Tracker`` protocol of ``rallyrl.tracking`` (``start(config)``, ``log(step,
metrics)``, ``close()``), runs on the main rank only and imports its package only when chosen (each is an
extra: ``pip install 'rallyrl[wandb]'``). What each does with rallyrl's settings:

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
import json
import math
import os
import secrets
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .config import TRACKERS, Config, ConfigError

# tracker -> (the module it needs, the extra that installs it)
PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
            "mlflow": ("mlflow", "mlflow"), "trackio": ("trackio", "trackio")}
STATE_FILE = "trackers.json"  # ids that let a resumed run continue the same tracker runs
_MAX_PARAM_CHARS = 500  # a longer config value (an inline prompt list) is shortened


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


def _exit_status() -> str:
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


def _project(cfg: Config, env: str) -> str:
    return cfg.train.project or os.environ.get(env) or "rallyrl"


def _run_name(cfg: Config, env: str | None = None) -> str:
    return cfg.train.run_name or (os.environ.get(env) if env else None) or Path(cfg.train.run_dir).resolve().name


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
        self.run = wandb.init(project=_project(self.cfg, "WANDB_PROJECT"), name=_run_name(self.cfg, "WANDB_NAME"),
                              id=run_id, resume="allow", config=param_values(config), dir=os.environ.get("WANDB_DIR"),
                              mode=mode if mode in ("online", "offline", "disabled", "shared") else None)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        # wandb refuses steps below the run's current one: after a resume, the iterations between the
        # checkpoint and the kill are already there (with the same values: resume is bit-exact).
        if step >= (getattr(self.run, "step", 0) or 0):
            self.run.log(scalars(metrics), step=step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish(exit_code=0 if _exit_status() == "finished" else 1)
            self.run = None


class Mlflow:
    """Through ``MlflowClient`` (no global active run: a user's own ``mlflow.start_run`` is untouched);
    ``MLFLOW_TRACKING_URI``, ``MLFLOW_EXPERIMENT_NAME`` / ``MLFLOW_EXPERIMENT_ID`` and ``MLFLOW_RUN_ID``
    apply."""

    def __init__(self, cfg: Config, state: TrackerState) -> None:
        self.cfg, self.state = cfg, state
        self.client: Any = None
        self.run_id: str | None = None

    def start(self, config: dict[str, Any]) -> None:
        from mlflow.entities import Param, RunStatus
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient()
        run_id = self.state.get("mlflow").get("run_id") or os.environ.get("MLFLOW_RUN_ID")
        if run_id and not self._exists(run_id):
            print(f"rallyrl: warning: the MLflow run {run_id} of this run directory is not in "
                  f"{self.client.tracking_uri}; logging to a new run", file=sys.stderr)
            run_id = None
        if run_id:
            self.client.update_run(run_id, status=RunStatus.to_string(RunStatus.RUNNING))
        else:
            exp_id = os.environ.get("MLFLOW_EXPERIMENT_ID")
            if not exp_id:
                name = _project(self.cfg, "MLFLOW_EXPERIMENT_NAME")
                exp = self.client.get_experiment_by_name(name)
                exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(name)
            run_id = self.client.create_run(exp_id, run_name=_run_name(self.cfg), tags={"rallyrl.run_dir": str(
                Path(self.cfg.train.run_dir).resolve())}).info.run_id
        self.run_id = run_id
        self.state.set("mlflow", {"run_id": run_id, "tracking_uri": self.client.tracking_uri})
        # A parameter cannot change value in MLflow: a resume adds only keys the run lacks (a change a
        # resume allowed is recorded in config_history.jsonl).
        have = self.client.get_run(run_id).data.params
        params = [Param(k, str(v)) for k, v in param_values(config).items() if k not in have]
        for i in range(0, len(params), 100):  # MLflow's limit per batch
            self.client.log_batch(run_id, params=params[i : i + 100])

    def _exists(self, run_id: str) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_run(run_id)
            return True
        except MlflowException:
            return False

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        rows = [Metric(k, v, now, step) for k, v in scalars(metrics).items()]
        for i in range(0, len(rows), 1000):
            self.client.log_batch(self.run_id, metrics=rows[i : i + 1000])

    def close(self) -> None:
        if self.run_id is not None:
            self.client.set_terminated(self.run_id, status=_exit_status().upper())
            self.run_id = None


class Trackio:
    """``trackio.init(project, name, config, resume)``; its local store is ``TRACKIO_DIR`` (default
    ``~/.cache/huggingface/trackio``); ``TRACKIO_SPACE_ID`` sends it to a Space."""

    def __init__(self, cfg: Config, state: TrackerState) -> None:
        self.cfg, self.state = cfg, state
        self.run: Any = None

    def start(self, config: dict[str, Any]) -> None:
        import trackio

        kept = self.state.get("trackio")
        project = kept.get("project") or _project(self.cfg, "TRACKIO_PROJECT")
        name = kept.get("name") or _run_name(self.cfg)
        self.run = trackio.init(project=project, name=name, config=param_values(config),
                                resume="allow" if kept else "never")
        self.state.set("trackio", {"project": project, "name": self.run.name})

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.run.log(scalars(metrics), step=step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


def create(names: Iterable[str], cfg: Config, state: TrackerState, tensorboard_dir: Any) -> list[Any]:
    """The trackers ``names`` (not started). ``tensorboard_dir()`` claims the run dir's ``tensorboard/``."""
    made: list[Any] = []
    for name in names:
        if name == "tensorboard":
            made.append(TensorBoard(cfg, tensorboard_dir()))
        elif name == "wandb":
            made.append(Wandb(cfg, state))
        elif name == "mlflow":
            made.append(Mlflow(cfg, state))
        elif name == "trackio":
            made.append(Trackio(cfg, state))
    return made
