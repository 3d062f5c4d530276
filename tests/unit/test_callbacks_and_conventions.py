"""Issue 20 items 4-6 at world size 1, without a model: callbacks (stop, errors naming the callback),
the model card, train.num_threads honouring OMP_NUM_THREADS, and progress as plain lines when stderr
is not a terminal."""

from __future__ import annotations

import pytest
import yaml

from rallyrl.callbacks import Callbacks
from rallyrl.config import load_config
from rallyrl.errors import CallbackError
from rallyrl.run.card import base_model, model_card
from rallyrl.run.console import RunLog, TrainResult
from rallyrl.trainer import num_threads

ROW = {"reward/mean": 0.5, "policy/kl": 0.01, "policy/total_loss": 1.0, "policy/clipfrac": 0.1,
       "time/iteration": 0.2}


class EarlyStop:
    """Stop once reward/mean reaches a threshold (the docs' example)."""

    def __init__(self, threshold: float) -> None:
        self.threshold, self.seen = threshold, []

    def on_iteration(self, step, metrics):
        self.seen.append(step)
        return "stop" if metrics["reward/mean"] >= self.threshold else None


class Recorder:
    def __init__(self):
        self.calls = []

    def on_start(self, info):
        self.calls.append(("start", info["start_iteration"], info["iterations"]))

    def on_eval(self, step, metrics):
        self.calls.append(("eval", step))


def test_stop_is_reported_by_name_and_every_callback_still_runs():
    early, rec = EarlyStop(0.5), Recorder()
    cbs = Callbacks([rec, early])
    assert cbs.iteration(1, {**ROW, "reward/mean": 0.1}) is False and cbs.stopped_by is None
    assert cbs.iteration(2, ROW) is True and cbs.stopped_by == "EarlyStop.on_iteration"
    assert early.seen == [1, 2]


def test_run_log_returns_the_stop_and_records_it(tmp_path, capsys):
    cfg = load_config({"train": {"progress": False, "iterations": 5}})
    rec = Recorder()
    log = RunLog(None, cfg, 0, TrainResult(tmp_path), [rec, EarlyStop(0.5)])
    assert log.iteration(1, {**ROW, "reward/mean": 0.0}) is False
    assert log.iteration(2, ROW) is True
    assert log.result.stopped_by == "EarlyStop.on_iteration" and log.result.iterations == 2
    assert "rallyrl: EarlyStop.on_iteration asked to stop: the run ends after iteration 2 of 5" in capsys.readouterr().err
    log.eval(3, {"eval/x": 1.0}, [])
    assert rec.calls == [("eval", 3)]


@pytest.mark.parametrize("callback, message", [
    (type("Boom", (), {"on_iteration": lambda self, s, m: 1 / 0})(),
     r"^callback Boom.on_iteration raised at iteration 4: ZeroDivisionError: division by zero$"),
    (type("Yes", (), {"on_iteration": lambda self, s, m: True})(),
     r"^callback Yes.on_iteration returned True at iteration 4; return 'stop' to end the run"),
])
def test_a_failing_callback_is_a_callback_error_naming_it(callback, message):
    with pytest.raises(CallbackError, match=message) as ei:
        Callbacks([callback]).iteration(4, ROW)
    if "raised" in message:
        assert "ZeroDivisionError" in ei.value.traceback_text  # the callback's own traceback, for RALLYRL_DEBUG


def test_an_object_without_hooks_is_refused_at_start():
    def on_iteration(step, metrics):  # a function, not an object with the method
        return None

    with pytest.raises(CallbackError, match=r"callbacks\[0\] \(on_iteration\) has none of the methods"):
        Callbacks([on_iteration]).start({})
    rec = Recorder()
    Callbacks([rec]).start({"start_iteration": 3, "iterations": 9})
    assert rec.calls == [("start", 3, 9)]


def test_num_threads_honours_omp_num_threads(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert num_threads(0) == 3
    assert num_threads(5) == 5  # the config key wins
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    import os

    assert num_threads(0) == max(1, os.cpu_count() or 1)


@pytest.mark.parametrize("terminal", [False, True])
def test_progress_is_plain_lines_unless_stderr_is_a_terminal(tmp_path, monkeypatch, capsys, terminal):
    monkeypatch.setattr("rallyrl.run.console.stderr_is_terminal", lambda: terminal)
    cfg = load_config({"train": {"progress": True, "iterations": 3}})
    log = RunLog(None, cfg, 0, TrainResult(tmp_path))
    for step in (1, 2, 3):
        log.iteration(step, ROW)
    log.close()
    err = capsys.readouterr().err
    if terminal:
        assert "\r" in err  # the bar redraws in place
    else:
        assert "\r" not in err
        assert err.splitlines() == [f"iter {s}/3 | reward 0.5000 | kl 0.0100 | loss 1.0000 | clipfrac 0.100 | 0.20s"
                                    for s in (1, 2, 3)]


def test_model_card_front_matter_and_contents(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct"}')
    cfg = load_config({"model": {"path": str(model)}, "reward": {"fn": "examples.task:reward"},
                       "train": {"run_dir": str(tmp_path / "my-run"), "iterations": 10},
                       "data": {"prompts": [f"p{i}" for i in range(100)]}})
    card = model_card(cfg, 7, {**ROW, "reward/len": 3.0}, {"eval/score": 0.1}, {"eval/score": 0.9},
                      stopped_by="EarlyStop.on_iteration", world_size=2)
    assert card.startswith("---\n")
    front = yaml.safe_load(card.split("---\n")[1])
    assert front == {"base_model": "HuggingFaceTB/SmolLM2-135M-Instruct", "library_name": "rallyrl",
                     "pipeline_tag": "text-generation",
                     "tags": ["rallyrl", "reinforcement-learning", "ppo", "text-generation"]}
    assert "# my-run" in card and "- algorithm: PPO (value head + GAE (gamma 1, lambda 0.95); clip range 0.2;" in card
    grpo = load_config({"ppo": {"estimator": "grpo", "group_scale": "none", "loss_aggregation": "seq_mean_token_sum",
                                "init_kl_coef": 0.0}, "rollout": {"samples_per_prompt": 4}})
    dr = model_card(grpo, 1, {}, {}, {})
    assert "- algorithm: Dr. GRPO (4 completions per prompt, group-normalised baseline, no value head; " \
           "clip range 0.2; 4 epoch(s)" in dr and "no KL penalty (no reference model)" in dr
    assert "dr-grpo" in yaml.safe_load(dr.split("---\n")[1])["tags"]
    # only a run that trained a value head says it is left out (issue 28 item 7: a GRPO card mentioned one)
    assert "The value head used in training is not part of this folder." in card
    assert "value head used in training" not in dr
    assert "- iterations: 7 of 10 (stopped early by the callback EarlyStop.on_iteration), 64 rollouts each, " \
           "on 2 process(es)" in card
    assert "| `reward/mean` | 0.5 |" in card and "| `policy/kl` | 0.01 |" in card
    assert "| `eval/score` | 0.1 | 0.9 |" in card
    config = yaml.safe_load(card.split("```yaml\n")[1].split("```")[0])
    assert config["reward"]["fn"] == "examples.task:reward" and config["data"]["prompts"].startswith("<100 items")
    # a local folder without a recorded hub id: the path, and the card says so
    assert base_model(load_config({"model": {"path": str(tmp_path)}})) == (str(tmp_path), False)
    assert base_model(load_config({"model": {"path": "gpt2-org/gpt2"}})) == ("gpt2-org/gpt2", True)
