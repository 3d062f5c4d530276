"""The checkpoint stage's schedule (``run.stage``), without a model: every ``checkpoint.interval``
iterations, and once ``checkpoint.interval_minutes`` have passed since the last checkpoint or the start."""

from __future__ import annotations

import time
from types import SimpleNamespace

from rallyrl.config import load_config
from rallyrl.run import stage


def _schedule(monkeypatch, last_at, **checkpoint):
    """Run the stage for iterations 1..6; returns the iterations that saved."""
    ckpt = load_config({"checkpoint": {"on_signal": False, **checkpoint}}).checkpoint
    run_dir = SimpleNamespace(last_checkpoint_at=last_at)
    saved = []

    def save(rd, step, *args):
        saved.append(step)
        rd.last_checkpoint_at = time.monotonic()

    monkeypatch.setattr(stage, "save_checkpoint", save)
    for step in range(1, 7):
        stage.checkpoint_stage(run_dir, step, None, None, None, ckpt)
        if step == 3:
            run_dir.last_checkpoint_at -= 31 * 60  # half an hour passes during iteration 4
    return saved


def test_the_default_is_a_checkpoint_every_30_minutes(monkeypatch):
    assert load_config({}).checkpoint.interval_minutes == 30
    assert _schedule(monkeypatch, time.monotonic()) == [4]  # once, then the clock starts again
    assert _schedule(monkeypatch, time.monotonic() - 31 * 60) == [1, 4]  # a run slower than that: at once


def test_iteration_and_time_based_checkpoints_combine_and_each_can_be_off(monkeypatch):
    assert _schedule(monkeypatch, time.monotonic(), interval=2) == [2, 4, 6]
    assert _schedule(monkeypatch, time.monotonic(), interval=5) == [4, 5]
    assert _schedule(monkeypatch, time.monotonic(), interval=0, interval_minutes=0) == []
    assert _schedule(monkeypatch, time.monotonic(), interval=2, interval_minutes=0) == [2, 4, 6]
