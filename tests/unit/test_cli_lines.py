"""The CLI's shape and its one line per failure, without a model or a process (ms).

The launcher's choice of which failure to show (``launch._first_failure``) is a pure function of the
workers' exit codes and their reports, tested here on hand-made outcomes; the real multi-process paths
are in tests/dist/test_launcher.py.
"""

from __future__ import annotations

import signal
import subprocess
from types import SimpleNamespace

import pytest

from rallyrl import __version__
from rallyrl.cli import _user_errors, describe, main
from rallyrl.config import ConfigError
from rallyrl.launch import _first_failure, _Worker, _read_reports, write_report


def test_help_and_version_need_no_config(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "train" in out and "check" in out and "RALLYRL_DEBUG" in out
    for sub in ("train", "check"):
        assert main([sub, "--help"]) == 0
        out = capsys.readouterr().out
        assert "--set KEY=VALUE" in out and "--nproc N" in out
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"rallyrl {__version__}"


@pytest.mark.parametrize("argv, needle", [
    ([], "the following arguments are required: <command>"),
    (["trian", "c.yaml"], "invalid choice: 'trian'"),
    (["train"], "the following arguments are required: config"),
    (["train", "c.yaml", "--nproc", "0"], "argument --nproc: must be >= 1, got 0"),
    (["check", "c.yaml", "--nproc", "two"], "argument --nproc: expected a whole number, got 'two'"),
    (["train", "c.yaml", "--lr", "3"], "unrecognized arguments: --lr 3"),
])
def test_usage_errors_are_one_line_exit_2(capsys, argv, needle):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("rallyrl: error: ") and needle in err, err
    assert "(see 'rallyrl" in err and "usage:" not in err


def test_user_errors_exit_2_runtime_errors_exit_1():
    users = _user_errors()
    assert describe(ConfigError("ppo.lr must be > 0, got 0"), users) == (2, "rallyrl: error: ppo.lr must be > 0, got 0")
    code, line = describe(FileNotFoundError(2, "No such file or directory", "runs/x/eval.jsonl"), users)
    assert code == 2 and line.startswith("rallyrl: error: No such file or directory: runs/x/eval.jsonl (check")
    code, line = describe(RuntimeError("gloo: connection closed\nException raised from recv at pair.cc\nframe #0"),
                          users)
    assert (code, line) == (1, "rallyrl: RuntimeError: gloo: connection closed")
    assert describe(ValueError(""), users) == (1, "rallyrl: ValueError: (no message)")


def test_checkpoint_errors_are_user_errors_with_the_fix():
    from rallyrl.errors import CheckpointError

    code, line = describe(CheckpointError("train.resume=latest: no valid checkpoint in runs/x/checkpoints (...)"),
                          _user_errors())
    assert code == 2
    assert line == ("rallyrl: error: train.resume=latest: no valid checkpoint in runs/x/checkpoints (...) (resume "
                    "from the newest valid checkpoint with --set train.resume=auto, or start over with --set "
                    "train.resume=auto --set train.overwrite=true (it removes only rallyrl's own files))")


def test_a_reward_error_shows_its_first_line_and_debug_adds_the_traceback(capsys, monkeypatch):
    from rallyrl.cli import _report
    from rallyrl.reward.step import Failure, RewardError

    try:
        raise ValueError("reward model exploded")
    except ValueError as e:
        failure = Failure.of(e, 0)
    err = RewardError.from_failures([failure, None])
    code, line = describe(err, _user_errors())
    assert (code, line) == (1, "rallyrl: RewardError: reward step failed on rank 0: ValueError: reward model exploded")
    monkeypatch.delenv("RALLYRL_REPORT_DIR", raising=False)
    monkeypatch.setenv("RALLYRL_DEBUG", "1")
    _report(code, line, err)
    printed = capsys.readouterr().err
    assert printed.rstrip().endswith(line) and "original traceback:" in printed and "reward model exploded" in printed


# --------------------------------------------------------------------------------------------------
# which failure the launcher shows


def _w(rank: int, rc: int, exited_at: float = 0.0, signalled: bool = False) -> _Worker:
    return _Worker(rank, SimpleNamespace(returncode=rc), exited_at, signalled)  # type: ignore[arg-type]


def _rep(rank: int, line: str, t: float, code: int = 1) -> dict:
    return {"rank": rank, "code": code, "line": line, "time": t}


def test_the_earliest_report_wins_and_names_its_rank():
    workers = [_w(0, 1, 5.0), _w(1, 1, 5.1)]
    reports = {0: _rep(0, "rallyrl: RuntimeError: peer gone", 4.0), 1: _rep(1, "rallyrl: RuntimeError: oops", 3.0)}
    assert _first_failure(workers, reports) == (1, "rallyrl: RuntimeError: oops (on rank 1)")


def test_the_same_line_on_every_rank_is_shown_once_as_it_is():
    line = "rallyrl: error: train.run_dir runs/x already holds a run"
    workers = [_w(0, 2), _w(1, 2)]
    assert _first_failure(workers, {0: _rep(0, line, 2.0, 2), 1: _rep(1, line, 1.0, 2)}) == (2, line)


def test_a_line_that_names_its_rank_is_not_annotated():
    line = "rallyrl: RewardError: reward step failed on rank 0: ValueError: boom"
    workers = [_w(0, 1), _w(1, -9, signalled=True)]  # rank 1 was killed by the launcher after the grace
    assert _first_failure(workers, {0: _rep(0, line, 1.0)}) == (1, line)


def test_a_worker_killed_by_an_unexpected_signal_is_the_root_cause():
    workers = [_w(0, 1, 2.0), _w(1, -signal.SIGKILL, 2.5)]
    reports = {0: _rep(0, "rallyrl: RuntimeError: Connection closed by peer", 1.0)}  # noticed it first
    code, line = _first_failure(workers, reports)
    assert code == 137 and line.startswith("rallyrl: WorkerKilled: rank 1 was killed by SIGKILL (exit code 137)")


def test_a_silent_non_zero_exit_is_named():
    workers = [_w(0, 0), _w(1, 3, 1.0)]
    assert _first_failure(workers, {}) == (3, "rallyrl: WorkerFailed: rank 1 exited with code 3 without an error message")


def test_reports_round_trip(tmp_path):
    write_report(str(tmp_path), 1, 2, "rallyrl: error: x")
    (tmp_path / "rank0.json").write_text("{half")  # unreadable: ignored
    got = _read_reports(tmp_path)
    assert list(got) == [1] and got[1]["line"] == "rallyrl: error: x" and got[1]["code"] == 2


def test_subprocess_is_not_started_by_help(monkeypatch, capsys):
    def boom(*a, **k):
        raise AssertionError("started a process")

    monkeypatch.setattr(subprocess, "Popen", boom)
    assert main(["train", "--help"]) == 0
