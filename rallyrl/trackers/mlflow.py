"""MLflow (``train.report_to: [mlflow]``; the ``mlflow`` extra)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from ..config import Config, ConfigError
from .common import TrackerState, exit_status, param_values, project_name, run_name, scalars


def check(reach: bool) -> str:
    """Where MLflow would log (``MLFLOW_TRACKING_URI``, else mlflow's own default) and, what can be seen
    without starting a run, whether it can: a local store's folder is writable, and (``reach``:
    ``rallyrl check``) a tracking server answers a connection. Other stores are named, not checked."""
    import socket
    from urllib.parse import urlsplit

    uri = os.environ.get("MLFLOW_TRACKING_URI") or _default_uri()
    parts = urlsplit(uri)
    if parts.scheme in ("http", "https"):
        if reach:
            port = parts.port or (443 if parts.scheme == "https" else 80)
            try:
                socket.create_connection((parts.hostname or "", port), timeout=5).close()
            except OSError as e:
                raise ConfigError(f"train.report_to: mlflow cannot reach its tracking server {uri} "
                                  f"(MLFLOW_TRACKING_URI): {e.strerror or e}; start the server, fix the "
                                  f"variable, or drop mlflow from train.report_to") from None
            return f"mlflow: tracking server {uri} (reachable)"
        return f"mlflow: tracking server {uri}"
    if parts.scheme in ("", "file", "sqlite"):
        # (sqlite:///rel.db is relative, sqlite:////abs.db absolute: the path is what follows the third /)
        local = Path(uri[len("sqlite:///"):] if parts.scheme == "sqlite" else parts.path if parts.scheme else uri)
        folder = local if parts.scheme in ("", "file") else local.parent
        existing = next((p for p in (folder, *folder.parents) if p.exists()), Path("/"))
        if not os.access(existing, os.W_OK):
            raise ConfigError(f"train.report_to: mlflow would write to {uri} (MLFLOW_TRACKING_URI), but {existing} "
                              f"is not writable: set MLFLOW_TRACKING_URI to a folder you can write, or drop mlflow "
                              f"from train.report_to")
        return f"mlflow: local store {uri}"
    return f"mlflow: tracking URI {uri} (not checked)"


def _default_uri() -> str:
    """mlflow's own choice when ``MLFLOW_TRACKING_URI`` is unset (``./mlruns`` or ``sqlite:///mlflow.db``)."""
    import mlflow

    return mlflow.get_tracking_uri()


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
                name = project_name(self.cfg, "MLFLOW_EXPERIMENT_NAME")
                exp = self.client.get_experiment_by_name(name)
                exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(name)
            run_id = self.client.create_run(exp_id, run_name=run_name(self.cfg), tags={"rallyrl.run_dir": str(
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
            self.client.set_terminated(self.run_id, status=exit_status().upper())
            self.run_id = None
