"""A signal in the launcher's first seconds, before any worker exists (issue 28 item 7: SIGTERM and
SIGUSR1 there killed it with no message, exit 143/138): one line and the exit code a stop gets. Run
in-process, without a model: the launcher's check is replaced by one that receives the signal."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

import rallyrl.cli as cli


@pytest.fixture
def config(tmp_path, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("a worker was started")

    monkeypatch.setattr(subprocess, "Popen", boom)
    path = tmp_path / "c.yaml"
    path.write_text(f"train:\n  run_dir: {tmp_path / 'run'}\n")
    return path


def _signalled(monkeypatch, signum):
    def preflight(*args, **kwargs):  # the launcher is loading the tokenizer and prompts when it comes
        os.kill(os.getpid(), signum)
        raise AssertionError("the signal did not stop the check")

    monkeypatch.setattr(cli, "preflight", preflight)


@pytest.mark.parametrize("signum, on_signal, code", [
    (signal.SIGTERM, True, 143), (signal.SIGUSR1, True, 143),  # a pre-emption: what a later one exits with
    (signal.SIGTERM, False, 143), (signal.SIGINT, True, 130),
])
def test_a_signal_before_the_workers_start_is_one_line(config, monkeypatch, capsys, signum, on_signal, code):
    _signalled(monkeypatch, signum)
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    rc = cli.main(["train", str(config), "--nproc", "2", "--set", f"checkpoint.on_signal={str(on_signal).lower()}"])
    err = capsys.readouterr().err
    assert rc == code and err.count("\n") == 1, err
    assert err.startswith(f"rallyrl: stopped by {signal.Signals(signum).name} before any worker started"), err
    assert "run the same command again" in err
    assert {s: signal.getsignal(s) for s in before} == before  # the handlers are given back
    assert not (config.parent / "run").exists()  # nothing written


def test_help_says_ppo_grpo_and_rloo(capsys):
    assert cli.main(["--help"]) == 0
    assert "(PPO, GRPO, RLOO)" in " ".join(capsys.readouterr().out.split())  # (argparse wraps the lines)
    assert cli.main(["train", "--help"]) == 0
    assert "PPO, GRPO or RLOO" in " ".join(capsys.readouterr().out.split())
