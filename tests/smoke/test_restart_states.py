"""Issue 28 item 1: a restart that always works. Each state a run directory can be in is built for real
(the tiny model, one process, ``rallyrl.cli.main`` in-process); ``train.resume: auto`` starts in every
state it can start in, and every refusal, in every state, names a command that works there: the test
FOLLOWS each ``--set`` command a refusal names (on a copy of the state) and requires a successful start.
A user's own files in the folder stay untouched throughout."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from rallyrl.cli import main
from rallyrl.run.lock import RunDirLock
from rallyrl.run.logs import read_jsonl
from tests.helpers.runs import base_config, write_config

pytestmark = pytest.mark.smoke

# a command a message names: one or more `--set key=value` items in a row
COMMAND = re.compile(r"--set \S+?=[^\s,;)]+(?: --set \S+?=[^\s,;)]+)*")
QUIET = ["train.save_final=false", "checkpoint.interval_minutes=0"]  # (what no state here needs)


def _config(model: Path, run_dir: Path) -> dict:
    return base_config(model, run_dir, train={"iterations": 2}, rollout={"num_rollouts": 2},
                       ppo={"num_minibatches": 1, "epochs": 1}, generation={"max_new_tokens": 4})


def _train(cfg: Path, capsys, *sets: str) -> tuple[int, list[str]]:
    rc = main(["train", str(cfg), *[a for s in [*QUIET, *sets] for a in ("--set", s)]])
    return rc, capsys.readouterr().err.strip().splitlines()


def _refused(cfg: Path, capsys, *sets: str) -> str:
    rc, err = _train(cfg, capsys, *sets)
    assert rc == 2 and len(err) == 1 and err[0].startswith("rallyrl: error: "), err
    return err[0]


def _commands(line: str) -> list[list[str]]:
    return [[item.split(" ", 1)[1] for item in re.findall(r"--set \S+", c)] for c in COMMAND.findall(line)]


def _follow(model: Path, line: str, state: Path, work: Path, capsys, *sets: str) -> list[tuple[list[str], bool]]:
    """Run every command ``line`` names, each on its own copy of ``state`` (the same command plus the
    named ``--set`` items, as a user would). Each must lead to a successful start: at once, or by following
    the advice of the one refusal it gets. Returns each command and whether it worked at once."""
    commands = _commands(line)
    assert commands, f"the message names no command: {line}"
    out = []
    for i, command in enumerate(commands):
        run = work / f"follow{i}" / "run"
        run.parent.mkdir(parents=True, exist_ok=True)
        if state.exists():
            shutil.copytree(state, run)
        cfg = write_config(work / f"follow{i}" / "c.yaml", _config(model, run))
        rc, err = _train(cfg, capsys, *sets, *command)
        if rc != 0:  # refused again: its own advice must then work at once
            assert rc == 2 and len(err) == 1 and _commands(err[0]), (line, command, err)
            shutil.rmtree(run, ignore_errors=True)
            if state.exists():
                shutil.copytree(state, run)
            again = _commands(err[0])
            assert any(_train(cfg, capsys, *sets, *command, *c)[0] == 0 for c in again), (line, command, err)
        if (state / "notes.txt").exists():
            assert (run / "notes.txt").read_text() == "mine"
        out.append((command, rc == 0))
    return out


@pytest.fixture(scope="module")
def states(tiny_model, tmp_path_factory):
    """The states built once: a run killed before its first checkpoint (2 iterations logged, no
    checkpoint), and a run with checkpoints step_1 and step_2; each with a user's notes.txt beside."""
    root = tmp_path_factory.mktemp("states")
    built = {"model": tiny_model}
    for name, interval in (("no_checkpoint", 0), ("checkpoints", 1)):
        run = root / name
        cfg = write_config(root / f"{name}.yaml", _config(tiny_model, run))
        assert main(["train", str(cfg), "--set", f"checkpoint.interval={interval}",
                     *[a for s in QUIET for a in ("--set", s)]]) == 0
        (run / "notes.txt").write_text("mine")
        built[name] = run
    return built


def _state(states, name: str, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of a built state and its config file."""
    run = tmp_path / "state" / "run"
    shutil.copytree(states[name], run)
    return run, write_config(tmp_path / "state" / "c.yaml", _config(states["model"], run))


def _all_at_once(followed: list[tuple[list[str], bool]]) -> list[list[str]]:
    assert all(at_once for _, at_once in followed), followed
    return [c for c, _ in followed]


def test_an_empty_folder_starts_and_latest_names_the_way(states, tmp_path, capsys):
    run = tmp_path / "state" / "run"
    cfg = write_config(tmp_path / "c.yaml", _config(states["model"], run))
    line = _refused(cfg, capsys, "train.resume=latest")
    assert "no checkpoint in" in line and not run.exists()
    followed = _follow(states["model"], line, run, tmp_path, capsys, "train.resume=latest")
    assert _all_at_once(followed) == [["train.resume=auto"]]
    rc, err = _train(cfg, capsys, "train.resume=auto")
    assert rc == 0 and not any("starting it over" in x for x in err)


def test_a_run_without_a_checkpoint_starts_over_with_auto_in_one_line(states, tmp_path, capsys):
    run, cfg = _state(states, "no_checkpoint", tmp_path)
    line = _refused(cfg, capsys)  # a plain start: the folder holds a run
    assert "already holds a run with no checkpoint to resume (2 iterations logged)" in line
    followed = _follow(states["model"], line, run, tmp_path / "plain", capsys)
    assert _all_at_once(followed) == [["train.resume=auto"], ["train.overwrite=true"]]
    line = _refused(cfg, capsys, "train.resume=latest")
    followed = _follow(states["model"], line, run, tmp_path / "latest", capsys, "train.resume=latest")
    assert _all_at_once(followed) == [["train.resume=auto"]]
    rc, err = _train(cfg, capsys, "train.resume=auto")
    notices = [x for x in err if "starting it over" in x]
    assert rc == 0 and len(notices) == 1 and "2 iterations logged" in notices[0], err
    assert (run / "notes.txt").read_text() == "mine" and [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2]


def test_a_run_with_checkpoints_resumes_with_auto(states, tmp_path, capsys):
    run, cfg = _state(states, "checkpoints", tmp_path)
    line = _refused(cfg, capsys)
    assert "(newest checkpoint step_2)" in line
    followed = _follow(states["model"], line, run, tmp_path / "plain", capsys)
    assert _all_at_once(followed) == [["train.resume=auto"], ["train.overwrite=true"]]
    rc, err = _train(cfg, capsys, "train.resume=auto", "train.iterations=3")
    assert rc == 0 and any("resumed from" in x and "step_2" in x for x in err), err
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3]


def test_a_changed_config_names_the_permission(states, tmp_path, capsys):
    run, cfg = _state(states, "checkpoints", tmp_path)
    rc, err = _train(cfg, capsys, "train.resume=auto", "ppo.lr=0.5")
    assert rc == 2 and "ppo.lr: 0.001 -> 0.5" in "\n".join(err), err
    commands = [c for c in COMMAND.findall("\n".join(err))]
    assert commands == ["--set train.allow_config_change=true"]
    rc, err = _train(cfg, capsys, "train.resume=auto", "ppo.lr=0.5", "train.allow_config_change=true")
    assert rc == 0, err


@pytest.mark.parametrize("damage", ["truncate", "checksum"])
def test_a_corrupt_newest_checkpoint_falls_back_in_one_line(states, tmp_path, capsys, damage):
    run, cfg = _state(states, "checkpoints", tmp_path)
    _damage(run / "checkpoints" / "step_2", damage)
    rc, err = _train(cfg, capsys, "train.resume=auto")
    said = [x for x in err if "invalid" in x]
    assert rc == 0 and len(said) == 1 and said[0].startswith("rallyrl: resuming from step_1: the newer checkpoint "
                                                             "step_2 is invalid (checkpoint "), err
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2]  # step 2 done again, logged once


@pytest.mark.parametrize("damage", ["manifest", "checksum"])
def test_only_invalid_checkpoints_are_never_silently_deleted(states, tmp_path, capsys, damage):
    """``auto`` refuses (starting over would delete them) and names the command that starts over; a
    quick look finds a missing manifest, only the checksums find the other (after the model loaded)."""
    run, cfg = _state(states, "checkpoints", tmp_path)
    for step in (1, 2):
        _damage(run / "checkpoints" / f"step_{step}", damage)
    for sets in ([], ["train.resume=auto"], ["train.resume=latest"]):
        line = _refused(cfg, capsys, *sets)
        assert (run / "checkpoints" / "step_1").is_dir(), line
        followed = _follow(states["model"], line, run, tmp_path / "-".join(sets or ["plain"]), capsys, *sets)
        if damage == "manifest" or sets:  # (the quick look sees it: every named command works at once)
            assert "invalid" in line and _all_at_once(followed), line
        else:  # a plain start takes the checkpoints for valid: of its two commands, starting over works at once
            assert followed == [(["train.resume=auto"], False), (["train.overwrite=true"], True)], line


def test_a_file_of_the_users_under_an_output_name_is_moved_by_the_user(states, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("mine: true\n")
    cfg = write_config(tmp_path / "c.yaml", _config(states["model"], run))
    line = _refused(cfg, capsys, "train.resume=auto")
    assert "which rallyrl did not write and would replace; move it" in line
    (run / "config.yaml").rename(tmp_path / "my-config.yaml")  # the advice, followed
    assert _train(cfg, capsys, "train.resume=auto")[0] == 0


def test_a_busy_folder_says_whom_to_wait_for(states, tmp_path, capsys):
    run, cfg = _state(states, "checkpoints", tmp_path)
    held = RunDirLock.acquire(run)
    try:
        line = _refused(cfg, capsys, "train.resume=auto")
        assert "is in use by pid" in line and "wait for that job to end" in line
    finally:
        held.release()  # the job ended
    assert _train(cfg, capsys, "train.resume=auto")[0] == 0


def _damage(folder: Path, how: str) -> None:
    policy = folder / "policy.safetensors"
    if how == "truncate":
        policy.write_bytes(policy.read_bytes()[:100])
    elif how == "checksum":  # the same size, another content: only the checksum tells
        data = bytearray(policy.read_bytes())
        data[-1] ^= 0xFF
        policy.write_bytes(bytes(data))
    else:
        (folder / "manifest.json").unlink()
