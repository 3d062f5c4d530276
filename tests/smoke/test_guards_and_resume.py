"""Trainer-side guards: a non-finite update never reaches the weights; an allowed config change on
resume really takes effect and is recorded; Ctrl-C says where to resume from."""

import json
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml
from safetensors.torch import load_file

import rallyrl
from rallyrl.errors import NonFiniteError
from rallyrl.run.logs import read_jsonl
from tests.helpers.runs import ROOT, base_config, env, write_config

pytestmark = pytest.mark.smoke


def _weights_equal(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


def test_nonfinite_update_stops_every_rank_and_weights_stay_finite(tiny_model, tmp_path):
    cfg = base_config(tiny_model, tmp_path / "run", reward={"fn": "tests.helpers.rewards:huge"},
                      checkpoint={"interval": 1})
    with pytest.raises(NonFiniteError, match=r"iteration 1: the loss or the gradient norm became NaN/inf"):
        rallyrl.train(cfg)
    assert not (tmp_path / "run" / "final").exists()  # nothing is written from a non-finite state
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_nonfinite_steps_can_be_skipped_and_are_counted(tiny_model, tmp_path):
    cfg = base_config(tiny_model, tmp_path / "run", reward={"fn": "tests.helpers.rewards:huge"},
                      ppo={"max_nonfinite_skips": 100})
    result = rallyrl.train(cfg)
    steps = 2 * 2  # epochs x minibatches per iteration, all skipped
    assert [m["policy/nonfinite_skips"] for m in result.metrics] == [steps, 2 * steps]
    assert all(m["policy/optimizer_steps"] == 0 for m in result.metrics)
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert all("NaN" not in r and "Infinity" not in r for r in rows)  # strict JSON: null, never NaN
    # no step was applied: the policy is the initial model
    assert _weights_equal(load_file(tiny_model / "model.safetensors"),
                          load_file(tmp_path / "run" / "final" / "model.safetensors"))


def test_allowed_lr_change_on_resume_takes_effect(tiny_model, tmp_path):
    run = tmp_path / "run"
    cfg = base_config(tiny_model, run, checkpoint={"interval": 1})
    rallyrl.train(cfg)
    bigger = base_config(tiny_model, run, checkpoint={"interval": 1}, ppo={"lr": 5e-3},
                         train={"iterations": 3, "resume": "latest"})
    with pytest.raises(rallyrl.ConfigError, match=r"ppo.lr: 0.001 -> 0.005"):
        rallyrl.train(bigger)
    bigger["train"]["allow_config_change"] = True
    result = rallyrl.train(bigger)
    assert [m["policy/lr"] for m in result.metrics] == [5e-3]  # step 3 ran with the new lr
    assert yaml.safe_load((run / "config.yaml").read_text())["ppo"]["lr"] == 1e-3  # the record stands
    (row,) = [json.loads(x) for x in (run / "config_history.jsonl").read_text().splitlines()]
    assert row["iteration"] == 2 and any(c["key"] == "ppo.lr" for c in row["changes"])
    assert [m["step"] for m in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3]


def test_resume_auto_is_one_command_for_start_and_restart(tiny_model, tmp_path):
    run = tmp_path / "run"
    cfg = base_config(tiny_model, run, checkpoint={"interval": 1}, train={"resume": "auto"})
    rallyrl.train(cfg)  # nothing to resume: a fresh start
    cfg["train"]["iterations"] = 3
    result = rallyrl.train(cfg)  # the same command again: continues from step_2
    assert len(result.metrics) == 1
    assert [m["step"] for m in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3]


def test_a_ctrl_c_whose_exception_was_swallowed_still_stops_the_run(tiny_model, tmp_path):
    """The reward swallows the KeyboardInterrupt of a real SIGINT: the signal was still seen, so the
    run stops at the next iteration, with the same line and exit code as a plain Ctrl-C."""
    cfg = base_config(tiny_model, tmp_path / "run", train={"iterations": 50},
                      reward={"fn": "tests.helpers.rewards:swallows_ctrl_c"})
    path = write_config(tmp_path / "c.yaml", cfg)
    proc = subprocess.run([sys.executable, "-m", "rallyrl.cli", "train", str(path)], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 130, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert [x for x in proc.stderr.splitlines() if "interrupted at iteration 2;" in x], proc.stderr[-2000:]
    assert len(read_jsonl(tmp_path / "run" / "metrics.jsonl")) <= 2  # the step-0 eval row and iteration 1


def test_ctrl_c_says_where_to_resume(tiny_model, tmp_path):
    cfg = base_config(tiny_model, tmp_path / "run", checkpoint={"interval": 1}, train={"iterations": 50},
                      reward={"fn": "tests.helpers.rewards:slow_hashed"})
    path = write_config(tmp_path / "c.yaml", cfg)
    proc = subprocess.Popen([sys.executable, "-m", "rallyrl.cli", "train", str(path)], cwd=ROOT,
                            env=env(RALLYRL_TEST_SLEEP="0.3"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 120
    while not (tmp_path / "run" / "checkpoints" / "step_1").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-2000:]
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err
    line = [x for x in err.splitlines() if "interrupted at iteration" in x]
    assert len(line) == 1 and "newest checkpoint step_" in line[0] and "train.resume=latest" in line[0], err
