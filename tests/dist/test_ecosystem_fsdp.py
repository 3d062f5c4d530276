"""Issue 20 items 1-4 together under model.sharding: fsdp on 2 processes: prompts from a parquet file
(memory-mapped Arrow, metadata aligned), a config that validates against `rallyrl schema`, mlflow
(read back through its client) and tensorboard from the main rank only, and a callback's "stop" after
iteration 2 of 4 ending both ranks with a checkpoint and final/."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rallyrl.run.logs import read_jsonl
from tests.helpers.runs import ROOT, base_config, env, write_config

pytestmark = pytest.mark.dist

PROMPTS = ["the cat", "a dog", "good morning", "what a", "i like", "the sun", "we walk", "birds sing"]


def test_parquet_schema_trackers_and_a_stop_under_fsdp(tiny_model, tmp_path, monkeypatch):
    import datasets
    import jsonschema
    from mlflow.tracking import MlflowClient

    from rallyrl.schema import config_schema

    datasets.Dataset.from_list([{"prompt": p, "expected_prompt": p, "id": i} for i, p in enumerate(PROMPTS)]
                               ).to_parquet(str(tmp_path / "p.parquet"))
    cfg = base_config(tiny_model, tmp_path / "run", data={"prompts": str(tmp_path / "p.parquet")},
                      rollout={"num_rollouts": 8, "chunk_size": 4, "samples_per_prompt": 2},
                      ppo={"estimator": "grpo", "init_kl_coef": 0.0, "num_minibatches": 2},
                      train={"iterations": 4, "report_to": ["mlflow", "tensorboard"]},
                      checkpoint={"interval": 3})
    cfg["model"].update(path=str(tiny_model), sharding="fsdp")
    jsonschema.validate(cfg, config_schema())  # the editor's view of the file agrees with the loader
    out = tmp_path / "ranks"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / "helpers" / "train_worker.py"), str(write_config(tmp_path / "c.yaml", cfg)), str(out)]
    mlruns = tmp_path / "mlruns"
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=env(RALLYRL_TEST_CALLBACKS="tests.helpers.callbacks:stop_at_2",
                                  RALLYRL_TEST_CALLBACK_LOG=str(tmp_path / "calls.jsonl"),
                                  MLFLOW_TRACKING_URI=f"file:{mlruns}", MLFLOW_ALLOW_FILE_STORE="true",
                                  HF_DATASETS_CACHE=str(tmp_path / "hf_cache")))
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["ok"] for r in ranks] == [True, True], ranks
    run = tmp_path / "run"
    rows = read_jsonl(run / "rollouts.jsonl")
    assert {r["step"] for r in rows} == {1, 2} and {r["rank"] for r in rows} == {0, 1}
    assert {r["prompt"] for r in rows} <= set(PROMPTS)
    # the stop after iteration 2 wrote its checkpoint (interval 3 would not have) and final/
    assert (run / "checkpoints" / "step_2").is_dir() and (run / "final" / "README.md").is_file()
    # mlflow: one run, from the main rank, with the config as parameters and both iterations' metrics
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow >= 3.7 wants an opt-in for file stores
    client = MlflowClient(tracking_uri=f"file:{mlruns}")
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    assert len(runs) == 1 and runs[0].data.params["model.sharding"] == "fsdp"
    hist = client.get_metric_history(runs[0].info.run_id, "reward/mean")
    metrics = read_jsonl(run / "metrics.jsonl")
    got = sorted((m.step, m.value) for m in hist)
    assert [s for s, _ in got] == [m["step"] for m in metrics] == [1, 2]
    assert [v for _, v in got] == pytest.approx([m["reward/mean"] for m in metrics])
    assert len(list((run / "tensorboard").glob("events.out.tfevents.*"))) == 1  # the main rank's only
