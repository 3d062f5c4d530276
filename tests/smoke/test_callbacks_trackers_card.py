"""Issue 20 items 2, 4 and 5 in a real single-process run on the tiny GPT-2: a callback stops the run
after iteration 2 of 4 (checkpoint, final/ with its model card, metrics to MLflow and W&B offline); a
resume continues to 4 in the same tracker runs; train.overwrite removes the card with final/."""

from __future__ import annotations

import json

import pytest
import yaml

import rallyrl
from rallyrl.run.logs import read_jsonl
from rallyrl.run.rundir import MANIFEST
from tests.helpers.runs import base_config
from tests.helpers.trackers import wandb_offline_run

pytestmark = pytest.mark.smoke


class StopAt:
    def __init__(self, step):
        self.step, self.calls = step, []

    def on_start(self, info):
        self.calls.append(("start", info["start_iteration"]))

    def on_eval(self, step, metrics):
        self.calls.append(("eval", step))

    def on_iteration(self, step, metrics):
        self.calls.append(("iteration", step, "reward/mean" in metrics))
        return "stop" if step == self.step else None


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eco")
    run_dir = tmp / "run"
    cfg = base_config(tiny_model, run_dir, data={"eval_prompts": ["the", "a dog"]},
                      train={"iterations": 4, "report_to": ["mlflow", "wandb"], "project": "eco"},
                      checkpoint={"interval": 3})
    with pytest.MonkeyPatch.context() as mp:
        for k, v in {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp), "WANDB_SILENT": "true",
                     "MLFLOW_TRACKING_URI": f"file:{tmp / 'mlruns'}", "MLFLOW_ALLOW_FILE_STORE": "true"}.items():
            mp.setenv(k, v)
        stop = StopAt(2)
        first = rallyrl.train(cfg, callbacks=[stop])
        card_first = (run_dir / "final" / "README.md").read_text()
        ids_first = json.loads((run_dir / "trackers.json").read_text())
        second = rallyrl.train(cfg, overrides=["train.resume=latest"])
        yield {"tmp": tmp, "run_dir": run_dir, "cfg": cfg, "stop": stop, "first": first, "second": second,
               "card_first": card_first, "ids_first": ids_first}


def test_a_callback_stops_the_run_cleanly_and_resumably(runs):
    run_dir, stop, first = runs["run_dir"], runs["stop"], runs["first"]
    assert stop.calls == [("start", 0), ("eval", 0), ("iteration", 1, True), ("iteration", 2, True)]
    assert first.stopped_by == "StopAt.on_iteration" and first.iterations == 2
    # the stop step is checkpointed (interval 3 alone would have saved none), so a resume continues there
    assert (run_dir / "checkpoints" / "step_2").is_dir()
    assert "- iterations: 2 of 4 (stopped early by the callback StopAt.on_iteration)" in runs["card_first"]
    assert [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")] == [0, 1, 2, 3, 4]
    assert runs["second"].iterations == 4 and runs["second"].stopped_by is None


def test_final_has_a_model_card(runs, tiny_model):
    card = (runs["run_dir"] / "final" / "README.md").read_text()
    front = yaml.safe_load(card.split("---\n")[1])
    assert front["library_name"] == "rallyrl" and front["base_model"] == str(tiny_model)
    assert "ppo" in front["tags"]
    assert "- iterations: 4 of 4, 7 rollouts each, on 1 process(es)" in card
    last = read_jsonl(runs["run_dir"] / "metrics.jsonl")[-1]
    assert f"| `reward/mean` | {last['reward/mean']:.4g} |" in card
    assert "| `eval/reward_mean` |" in card  # before training and after the last iteration
    assert "```yaml\nmodel:\n" in card


def test_trackers_got_every_iteration_and_the_resume_continued_their_runs(runs):
    from mlflow.tracking import MlflowClient

    ids = json.loads((runs["run_dir"] / "trackers.json").read_text())
    assert ids == runs["ids_first"]  # the resume kept the W&B id and the MLflow run
    rows = read_jsonl(runs["run_dir"] / "metrics.jsonl")
    client = MlflowClient(f"file:{runs['tmp'] / 'mlruns'}")
    hist = {m.step: m.value for m in client.get_metric_history(ids["mlflow"]["run_id"], "reward/mean")}
    assert hist == pytest.approx({r["step"]: r["reward/mean"] for r in rows if "reward/mean" in r})
    params = client.get_run(ids["mlflow"]["run_id"]).data.params
    assert params["rollout.num_rollouts"] == "7" and params["train.project"] == "eco"
    folders = sorted((runs["tmp"] / "wandb").glob("offline-run-*"))
    assert len(folders) == 2
    logged = [h for f in folders for h in wandb_offline_run(f)["history"] if "reward/mean" in h]
    assert {wandb_offline_run(f)["id"] for f in folders} == {ids["wandb"]["id"]}
    assert [h["_step"] for h in logged] == [1, 2, 3, 4]


def test_overwrite_removes_the_card_with_final(runs):
    run_dir = runs["run_dir"]
    assert "final" in json.loads((run_dir / MANIFEST).read_text())["dirs"]  # rallyrl's: README.md included
    rallyrl.train(runs["cfg"], overrides=["train.overwrite=true", "train.iterations=0", "train.save_final=false",
                                          "train.report_to=[]", "data.eval_prompts=null"])
    assert not (run_dir / "final").exists() and not (run_dir / "trackers.json").exists()
