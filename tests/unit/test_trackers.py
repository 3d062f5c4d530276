"""train.report_to (issue 20 item 2): each tracker gets the flattened config and every iteration's
metrics at step = iteration, from RunDir.open's writer (world size 1, no model); a resume continues the
same tracker run; a missing package names its extra. Read back offline: MLflow's file store through its
client, W&B's offline run folder, Trackio's local SQLite store."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rallyrl import trackers
from rallyrl.config import ConfigError, load_config
from rallyrl.errors import TrackerError
from rallyrl.run.rundir import MANIFEST, RunDir
from rallyrl.trackers.mlflow import Mlflow
from rallyrl.trackers.tensorboard import TensorBoard
from tests.helpers.runs import ROOT, env
from tests.helpers.trackers import wandb_offline_run


def _cfg(run_dir: Path, **train) -> object:
    return load_config({"train": {"run_dir": str(run_dir), **train}, "ppo": {"lr": 3e-4},
                        "data": {"prompts": ["a"] * 400}})


def _run(run_dir: Path, cfg, steps, resumed_from=None) -> None:
    rd = RunDir.check_start(run_dir, cfg, []) if resumed_from is None else RunDir(run_dir)  # (no checkpoint here)
    w = rd.open(cfg, resumed_from, steps[0])
    for s in steps:
        w.log_metrics(s, {"reward/mean": s / 2, "policy/kl": float("nan")})
    w.close()


def test_tensorboard_flag_is_report_to_tensorboard():
    assert trackers.chosen(load_config({"train": {"tensorboard": True}})) == ["tensorboard"]
    assert trackers.chosen(load_config({"train": {"report_to": "wandb"}})) == ["wandb"]
    both = load_config({"train": {"tensorboard": True, "report_to": ["mlflow", "tensorboard", "wandb"]}})
    assert trackers.chosen(both) == ["tensorboard", "wandb", "mlflow"]
    with pytest.raises(ConfigError, match=r"train.report_to\[1\]: expected one of .* got 'wandbb' \(did you mean 'wandb'"):
        load_config({"train": {"report_to": ["mlflow", "wandbb"]}})


def test_a_missing_tracker_package_names_its_extra(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(ConfigError, match=r"train.report_to: mlflow needs the mlflow package: pip install 'rallyrl\[mlflow\]'"):
        RunDir.check_start(tmp_path, _cfg(tmp_path, report_to=["mlflow"]), [])


def test_params_are_flat_and_long_values_shortened():
    flat = trackers.param_values({"ppo.lr": 3e-4, "data.prompts": ["x" * 10] * 400, "reward.kwargs": {"a": 1}})
    assert flat["ppo.lr"] == 3e-4 and flat["reward.kwargs"] == '{"a": 1}'
    assert len(flat["data.prompts"]) == 500 and flat["data.prompts"].endswith("...")


def test_mlflow_logs_config_and_metrics_and_a_resume_continues_the_run(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'mlruns'}")  # the tracker's own variable
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow >= 3.7 wants an opt-in for file stores
    run_dir = tmp_path / "my-run"
    cfg = _cfg(run_dir, report_to=["mlflow"], project="proj")
    _run(run_dir, cfg, [0, 1, 2])
    state = json.loads((run_dir / "trackers.json").read_text())
    assert "trackers.json" in json.loads((run_dir / MANIFEST).read_text())["files"]  # overwrite removes it
    client = MlflowClient()
    run = client.get_run(state["mlflow"]["run_id"])
    assert run.info.run_name == "my-run" and run.info.status == "FINISHED"  # default name: the run dir's
    assert client.get_experiment(run.info.experiment_id).name == "proj"
    assert run.data.params["ppo.lr"] == "0.0003" and run.data.params["train.report_to"] == '["mlflow"]'
    assert "policy/kl" not in run.data.metrics  # non-finite: left out (metrics.jsonl has null)
    _run(run_dir, cfg, [3], resumed_from=run_dir / "checkpoints" / "step_2")
    assert json.loads((run_dir / "trackers.json").read_text())["mlflow"]["run_id"] == run.info.run_id
    hist = client.get_metric_history(run.info.run_id, "reward/mean")
    assert sorted((m.step, m.value) for m in hist) == [(0, 0.0), (1, 0.5), (2, 1.0), (3, 1.5)]
    assert len(client.search_runs([run.info.experiment_id])) == 1


def test_wandb_offline_logs_config_and_metrics_and_a_resume_keeps_the_id(tmp_path, monkeypatch):
    for k, v in {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true",
                 "WANDB_PROJECT": "from-env"}.items():
        monkeypatch.setenv(k, v)
    run_dir = tmp_path / "run-a"
    cfg = _cfg(run_dir, report_to="wandb", run_name="named")
    _run(run_dir, cfg, [0, 1, 2])
    _run(run_dir, cfg, [3], resumed_from=run_dir / "checkpoints" / "step_2")
    first, second = [wandb_offline_run(f) for f in sorted((tmp_path / "wandb").glob("offline-run-*"))]
    run_id = json.loads((run_dir / "trackers.json").read_text())["wandb"]["id"]
    assert first["id"] == second["id"] == run_id  # synced, the two folders are one run
    assert first["project"] == "from-env" and first["name"] == "named"
    assert first["config"]["ppo.lr"] == 3e-4 and first["config"]["train.run_name"] == "named"
    assert [(h["_step"], h["reward/mean"]) for h in first["history"] + second["history"]] == \
        [(0, 0), (1, 0.5), (2, 1.0), (3, 1.5)]
    assert all("policy/kl" not in h for h in first["history"])


def test_trackio_local_store_holds_config_and_metrics_and_a_resume_continues(tmp_path):
    # TRACKIO_DIR is read when trackio is imported: a fresh interpreter sees this test's folder.
    script = textwrap.dedent(f"""
        import json
        from pathlib import Path
        from rallyrl.config import load_config
        from tests.unit.test_trackers import _run
        run_dir = Path({str(tmp_path / 'run-t')!r})
        cfg = load_config({{"train": {{"run_dir": str(run_dir), "report_to": ["trackio"]}}, "ppo": {{"lr": 3e-4}}}})
        _run(run_dir, cfg, [0, 1, 2])
        _run(run_dir, cfg, [3], resumed_from=run_dir / "checkpoints" / "step_2")
        from trackio.sqlite_storage import SQLiteStorage
        print("RESULT", json.dumps({{"runs": SQLiteStorage.get_runs("rallyrl"),
                                     "logs": SQLiteStorage.get_logs("rallyrl", "run-t"),
                                     "lr": SQLiteStorage.get_run_config("rallyrl", "run-t")["ppo.lr"]}}))
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=env(TRACKIO_DIR=str(tmp_path / "trackio")))
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.split("RESULT ", 1)[1].splitlines()[0])
    assert got["runs"] == ["run-t"] and got["lr"] == 3e-4
    assert [(r["step"], r["reward/mean"]) for r in got["logs"]] == [(0, 0), (1, 0.5), (2, 1.0), (3, 1.5)]


def test_a_tracker_that_cannot_start_is_a_tracker_error_and_closes_the_files(tmp_path, monkeypatch):
    def boom(self, config):
        raise OSError("tracking server unreachable")

    monkeypatch.setattr(Mlflow, "start", boom)
    cfg = _cfg(tmp_path, report_to=["mlflow"])
    rd = RunDir.check_start(tmp_path, cfg, [])
    with pytest.raises(TrackerError, match=r"starting the trackers \(train.report_to\) failed on rank 0: "
                                           r"OSError: tracking server unreachable"):
        rd.open(cfg, None, 0)


def test_a_tracker_failing_mid_run_is_dropped_with_a_warning(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(TensorBoard, "log", lambda self, step, m: 1 / 0)
    cfg = _cfg(tmp_path, tensorboard=True)
    w = RunDir.check_start(tmp_path, cfg, []).open(cfg, None, 0)
    w.log_metrics(1, {"reward/mean": 1.0})
    w.log_metrics(2, {"reward/mean": 2.0})
    w.close()
    err = capsys.readouterr().err
    assert err.count("tensorboard failed at iteration 1 (ZeroDivisionError") == 1
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_a_resume_whose_mlflow_run_is_elsewhere_starts_a_new_one(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    run_dir = tmp_path / "run"
    cfg = _cfg(run_dir, report_to=["mlflow"])
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'a'}")
    _run(run_dir, cfg, [0, 1])
    old = json.loads((run_dir / "trackers.json").read_text())["mlflow"]["run_id"]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'b'}")  # the user moved the store
    _run(run_dir, cfg, [2], resumed_from=run_dir / "checkpoints" / "step_1")
    new = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    assert new["run_id"] != old and new["tracking_uri"] == f"file:{tmp_path / 'b'}"
    assert f"the MLflow run {old} of this run directory is not in" in capsys.readouterr().err


@pytest.fixture
def no_wandb_login(tmp_path, monkeypatch):
    """An environment with no W&B login anywhere wandb looks (its variables, netrc, settings files)."""
    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_DISABLED", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-dir"))
    return tmp_path


def test_wandb_online_without_a_login_is_refused_before_anything_starts(no_wandb_login, monkeypatch):
    """Issue 28 item 7: it failed only in wandb.init, after ~40 s of start-up (and `check` passed)."""
    run = no_wandb_login / "run"
    cfg = _cfg(run, report_to=["wandb"])
    with pytest.raises(ConfigError) as e:
        RunDir.check_start(run, cfg, [])
    assert str(e.value).startswith("train.report_to: wandb logs online (WANDB_MODE=online) but finds no W&B login "
                                   "for https://api.wandb.ai: run `wandb login`, set WANDB_API_KEY, or log offline "
                                   "with WANDB_MODE=offline")
    # each way wandb finds a login, or needs none, passes
    (no_wandb_login / "netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    assert trackers.check(cfg) == [f"wandb: online to https://api.wandb.ai, login from {no_wandb_login / 'netrc'}"]
    (no_wandb_login / "netrc").unlink()
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    assert trackers.check(cfg) == ["wandb: online to https://api.wandb.ai, login from WANDB_API_KEY"]
    monkeypatch.delenv("WANDB_API_KEY")
    (no_wandb_login / "wandb-config").mkdir()
    (no_wandb_login / "wandb-config" / "settings").write_text("[default]\nmode = offline\n")  # `wandb offline`
    assert trackers.check(cfg)[0].startswith("wandb: offline (no login needed")
    monkeypatch.setenv("WANDB_MODE", "online")  # the variable wins over the settings file
    with pytest.raises(ConfigError, match="finds no W&B login"):
        trackers.check(cfg)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert trackers.check(cfg)[0].startswith("wandb: disabled")


def test_check_and_train_refuse_wandb_without_a_login_in_one_line(no_wandb_login, capsys, tiny_model):
    run = no_wandb_login / "run"
    path = no_wandb_login / "c.yaml"
    path.write_text(f"model:\n  path: {tiny_model}\ntrain:\n  run_dir: {run}\n  report_to: [wandb]\n"
                    f"data:\n  prompts: [a, b]\nrollout:\n  num_rollouts: 2\n"
                    f"reward:\n  fn: tests.helpers.rewards:hashed\n")
    from rallyrl.cli import main

    for command in ("check", "train"):
        assert main([command, str(path)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "finds no W&B login" in err, err
    assert not run.exists()  # refused before anything was written


def test_check_says_where_mlflow_logs_and_whether_it_can(tmp_path, monkeypatch):
    import socket

    cfg = _cfg(tmp_path / "run", report_to=["mlflow", "tensorboard"])
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file://{tmp_path / 'mlruns'}")
    assert trackers.check(cfg, reach=True) == ["tensorboard: installed", f"mlflow: local store file://{tmp_path / 'mlruns'}"]
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    assert trackers.check(cfg) == ["tensorboard: installed", "mlflow: installed"]  # train: no connection tried
    with pytest.raises(ConfigError, match=rf"mlflow cannot reach its tracking server http://127.0.0.1:{port} "
                                          rf"\(MLFLOW_TRACKING_URI\): .*start the server, fix the variable"):
        trackers.check(cfg, reach=True)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{server.getsockname()[1]}")
        assert trackers.check(cfg, reach=True)[1].endswith("(reachable)")
