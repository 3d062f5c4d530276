"""MLflow (``train.report_to: [mlflow]``; the ``mlflow`` extra)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from ..config import Config
from .common import TrackerState, exit_status, param_values, project_name, run_name, scalars


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
