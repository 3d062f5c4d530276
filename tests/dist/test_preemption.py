"""Pre-emption (`checkpoint.on_signal`, default on): a SIGTERM or SIGUSR1 reaching ONE rank of a
2-process run, during the update or in the middle of a checkpoint write (twice), makes every rank stop
after the same iteration with a checkpoint and exit 143; `train.resume: auto` then continues to a run
bit-identical to an uninterrupted one."""

import pytest
import torch
from safetensors.torch import load_file

from rallyrl.run.logs import read_jsonl
from tests.helpers.runs import base_config, rallyrl_train, write_config

pytestmark = pytest.mark.dist


def _cfg(model, run_dir):
    # checkpoint.interval 3: the stop after iteration 2 writes a checkpoint of its own (not an interval
    # one); the signal during iteration 3's (interval) checkpoint write stops with that checkpoint.
    return base_config(model, run_dir, train={"iterations": 4, "resume": "auto"},
                       checkpoint={"interval": 3, "keep_last": 5},
                       ppo={"target_kl": 0.5, "reward_scaling": "running"},
                       reward={"fn": "tests.helpers.rewards:signalling", "kwargs": {"unused": 0}})


def _stop_lines(proc):
    return [ln for ln in proc.stderr.splitlines() if "stopped by" in ln]


def test_a_signal_on_one_rank_stops_every_rank_with_a_checkpoint_and_resume_is_exact(tiny_model, tmp_path):
    ref = rallyrl_train(write_config(tmp_path / "a.yaml", _cfg(tiny_model, tmp_path / "A")), 2)
    assert ref.returncode == 0, ref.stderr[-3000:]

    cfg_b = write_config(tmp_path / "b.yaml", _cfg(tiny_model, tmp_path / "B"))
    ckpts = tmp_path / "B" / "checkpoints"
    # 1. SIGTERM to rank 1 alone, as it starts the update of iteration 2: both ranks finish iteration 2
    first = rallyrl_train(cfg_b, 2, RALLYRL_TEST_SIGNAL="update:1:2")
    assert first.returncode == 143, first.stderr[-3000:]
    assert "Traceback" not in first.stderr
    lines = _stop_lines(first)
    assert len(lines) == 1 and "SIGTERM after iteration 2" in lines[0], first.stderr[-3000:]
    assert str(ckpts / "step_2") in lines[0] and "train.resume=auto" in lines[0], lines
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_2"]
    assert [m["step"] for m in read_jsonl(tmp_path / "B" / "metrics.jsonl")] == [1, 2]

    # 2. resume: auto; SIGUSR1 then SIGTERM to rank 0 in the middle of writing step_3 (an interval
    # checkpoint): the write completes (atomic), then every rank stops; no iteration 4
    second = rallyrl_train(cfg_b, 2, RALLYRL_TEST_SIGNAL="checkpoint:0:3")
    assert second.returncode == 143, second.stderr[-3000:]
    assert "resumed from" in second.stderr
    lines = _stop_lines(second)
    assert len(lines) == 1 and "SIGUSR1 after iteration 3" in lines[0], lines  # the first signal is named
    assert str(ckpts / "step_3") in lines[0]
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_2", "step_3"]  # no .tmp_step_3 left
    assert [m["step"] for m in read_jsonl(tmp_path / "B" / "metrics.jsonl")] == [1, 2, 3]

    # 3. resume: auto to the end: the same run as the uninterrupted one
    last = rallyrl_train(cfg_b, 2)
    assert last.returncode == 0, last.stderr[-3000:]
    a = load_file(tmp_path / "A" / "final" / "model.safetensors")
    b = load_file(tmp_path / "B" / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    strip = lambda m: {k: v for k, v in m.items() if not k.startswith("time/")}  # noqa: E731
    ma, mb = read_jsonl(tmp_path / "A" / "metrics.jsonl"), read_jsonl(tmp_path / "B" / "metrics.jsonl")
    assert [strip(m) for m in ma] == [strip(m) for m in mb]
    assert read_jsonl(tmp_path / "A" / "rollouts.jsonl") == read_jsonl(tmp_path / "B" / "rollouts.jsonl")
