"""The progress line while the reward host takes long (issue 13 item 4): RunLog.waiting says
"waiting for the reward on rank 0, N s" after RALLYRL_WAIT_NOTICE_S (default 5 s), updated in place on
a progress bar, at doubling intervals in a plain log; and the reward step holds it exactly while the
main rank waits for rewards."""

from __future__ import annotations

import contextlib
import math
import time

import pytest

from rallyrl.config import load_config
from rallyrl.reward import NamedRewardFn, RewardStep, Samples
from rallyrl.run.console import RunLog, TrainResult, wait_notice_after_s


def _log(tmp_path, progress: bool) -> RunLog:
    cfg = load_config({"train": {"progress": progress, "iterations": 3}})
    return RunLog(None, cfg, 0, TrainResult(tmp_path))


def test_default_threshold_is_a_few_seconds(monkeypatch):
    monkeypatch.delenv("RALLYRL_WAIT_NOTICE_S", raising=False)
    assert wait_notice_after_s() == 5.0
    monkeypatch.setenv("RALLYRL_WAIT_NOTICE_S", "0.5")
    assert wait_notice_after_s() == 0.5


def test_plain_log_lines_double_their_interval(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RALLYRL_WAIT_NOTICE_S", "0.1")
    log = _log(tmp_path, progress=False)
    with log.waiting("waiting for the reward on rank 0"):
        time.sleep(0.05)  # shorter than the threshold: nothing is said
    assert capsys.readouterr().err == ""
    t0 = time.monotonic()
    with log.waiting("waiting for the reward on rank 0"):
        time.sleep(1.0)
    waited = time.monotonic() - t0
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln]
    assert lines and all(ln.startswith("rallyrl: waiting for the reward on rank 0, ") and ln.endswith(" s")
                         for ln in lines), lines
    # at 0.1, 0.2, 0.4, 0.8 s at most (never one per poll): a log is not flooded
    assert len(lines) <= math.floor(math.log2(waited / 0.1)) + 1, lines


def test_a_progress_bar_shows_it_as_its_postfix_and_clears_it(tmp_path, monkeypatch):
    monkeypatch.setenv("RALLYRL_WAIT_NOTICE_S", "0.1")
    monkeypatch.setattr("rallyrl.run.console.stderr_is_terminal", lambda: True)  # a bar needs a terminal
    log = _log(tmp_path, progress=True)
    seen = []
    with log.waiting("waiting for the reward on rank 0"):
        deadline = time.monotonic() + 20
        while not seen and time.monotonic() < deadline:
            if "waiting for the reward on rank 0, " in (log.bar.postfix or ""):
                seen.append(log.bar.postfix)
            time.sleep(0.02)
    assert seen and seen[0].endswith(" s")
    assert not log.bar.postfix  # cleared once the wait is over
    log.close()


def test_the_reward_step_holds_the_notice_while_the_main_rank_waits():
    held = []

    @contextlib.contextmanager
    def notice(what):
        held.append(("enter", what))
        yield
        held.append(("exit", what))

    def reward(samples, prompts, outputs, **kw):
        held.append(("call", None))
        return [0.0] * len(samples)

    s = Samples(["a"], ["b"], [[1]], [{}])
    step = RewardStep([NamedRewardFn("r", reward)], "main", notice=notice)
    step.collect([step.submit(s)])
    assert held == [("enter", "waiting for the reward on rank 0"), ("call", None),
                    ("exit", "waiting for the reward on rank 0")]
    held.clear()
    RewardStep([NamedRewardFn("r", reward)], "local", notice=notice)(s)
    assert held[0] == ("enter", "waiting for the rewards (local placement: every rank's call)")


@pytest.mark.parametrize("placement", ["main", "local", "collective"])
def test_time_wait_is_the_blocking_reward_time_when_synchronous(placement):
    def reward(samples, prompts, outputs, **kw):
        time.sleep(0.05)
        return [0.0] * len(samples)

    step = RewardStep([NamedRewardFn("r", reward)], placement)
    results = step.collect([step.submit(Samples(["a"], ["b"], [[1]], [{}])) for _ in range(2)])
    for _, st in results:
        assert st.time_wait == st.time_reward > 0
