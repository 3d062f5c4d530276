"""rallyrl's own writes to the run directory fail as ONE line (path, OS reason, hint), without a
traceback unless RALLYRL_DEBUG=1; user code keeps its traceback (no model, world size 1: ms)."""

from __future__ import annotations

import errno
import os

import pytest
from safetensors import SafetensorError

from rallyrl import dist
from rallyrl.cli import _report, _user_errors, describe
from rallyrl.config import load_config
from rallyrl.errors import CheckpointError, RunDirWriteError, os_error_of, writing
from rallyrl.run.rundir import RunDir


def _enospc(path=None):
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


def test_an_os_error_becomes_one_line_with_path_reason_and_hint(tmp_path):
    with pytest.raises(RunDirWriteError) as e:
        with writing(tmp_path / "x", "saving checkpoint runs/x/checkpoints/step_3", note="the last one is intact"):
            raise _enospc(str(tmp_path / "x" / "policy.safetensors"))
    assert str(e.value) == (f"saving checkpoint runs/x/checkpoints/step_3: cannot write {tmp_path}/x/policy.safetensors: "
                            f"No space left on device (ENOSPC); free space on that file system (or raise the quota), "
                            f"or point train.run_dir to one with room; the last one is intact")
    assert "Traceback" in e.value.traceback_text  # kept for RALLYRL_DEBUG=1


@pytest.mark.parametrize("code, hint", [(errno.EACCES, "writable by this user"), (errno.EROFS, "read-only"),
                                        (errno.EIO, "check the file system of train.run_dir")])
def test_the_hint_follows_the_os_reason(tmp_path, code, hint):
    with pytest.raises(RunDirWriteError, match=hint):
        with writing(tmp_path, "logging metrics"):
            raise OSError(code, os.strerror(code))  # no filename (a failed file.write): the path given is named


def test_safetensors_io_errors_are_read_back_as_os_errors():
    err = os_error_of(SafetensorError('Error while serializing: I/O error: No space left on device (os error 28) '
                                      'at path "/runs/x/.tmpAbC"'))
    assert (err.errno, err.filename) == (errno.ENOSPC, "/runs/x/.tmpAbC")
    assert os_error_of(SafetensorError("Error while deserializing header: HeaderTooLarge")) is None
    assert os_error_of(ValueError("not I/O")) is None


def test_other_errors_pass_through_unchanged(tmp_path):
    with pytest.raises(ValueError, match="a bug"):
        with writing(tmp_path, "logging metrics"):
            raise ValueError("a bug")


def test_through_agree_every_rank_raises_the_write_error_itself(tmp_path):
    def save():
        with writing(tmp_path, "saving checkpoint step_3"):
            raise _enospc()

    with pytest.raises(RunDirWriteError, match=r"^saving checkpoint step_3: cannot write .*No space left on device"):
        dist.agree(save, CheckpointError, main_only=True, what="saving checkpoint step_3")
    with pytest.raises(CheckpointError, match=r"failed on rank 0: ValueError: not an I/O error"):  # as before
        dist.agree(lambda: (_ for _ in ()).throw(ValueError("not an I/O error")), CheckpointError, main_only=True)


def test_a_failed_log_write_is_one_line_exit_2_and_debug_shows_the_traceback(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    cfg = load_config({"train": {"run_dir": str(run)}})
    writer = RunDir.check_start(run, cfg, []).open(cfg, None, 0)

    class FullDisk:  # metrics.jsonl's file object, on a full disk
        def write(self, text):
            raise _enospc()

    writer._metrics._f = FullDisk()
    with pytest.raises(RunDirWriteError) as e:
        writer.log_metrics(1, {"reward/mean": 1.0})
    code, line = describe(e.value, _user_errors())
    assert code == 2 and line == (f"rallyrl: error: logging metrics: cannot write {run}/metrics.jsonl: No space left on "
                                  f"device (ENOSPC); free space on that file system (or raise the quota), or point "
                                  f"train.run_dir to one with room")
    _report(code, line, e.value)
    assert capsys.readouterr().err == line + "\n"
    monkeypatch.setenv("RALLYRL_DEBUG", "1")
    _report(code, line, e.value)
    err = capsys.readouterr().err
    assert "Traceback" in err and "OSError: [Errno 28]" in err and err.endswith(line + "\n")
