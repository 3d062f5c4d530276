"""RunDir only ever touches its own files; a resume with a changed config is refused unless allowed
(world size 1: pure file operations, no model)."""

import json

import pytest
import yaml

from rallyrl.config import load_config
from rallyrl.run.lock import RunDirError
from rallyrl.run.rundir import MANIFEST, RunDir


def _cfg(run_dir, **train):
    return load_config({"train": {"run_dir": str(run_dir), **train}, "ppo": {"lr": 1e-3}})


def _fake_run(run_dir, steps=(1, 2)):
    """What a finished run leaves: written through RunDir, so the manifest lists it."""
    cfg = _cfg(run_dir)
    rd = RunDir.check_start(run_dir, cfg, [0])
    w = rd.open(cfg, None, 0)
    for s in steps:
        w.log_metrics(s, {"reward/mean": float(s)})
    w.log_eval_samples(0, [{"index": 0}])
    w.close()
    rd.claim("final", is_dir=True)
    (run_dir / "final" / "model.safetensors").write_bytes(b"x")
    return rd


def _fake_checkpoint(run_dir, step):
    """A checkpoint folder that passes the quick look (a manifest listing no files): no model here."""
    folder = run_dir / "checkpoints" / f"step_{step}"
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text(json.dumps({"format": 1, "step": step, "files": {}}))
    return folder


def test_users_config_yaml_is_never_replaced(tmp_path):
    (tmp_path / "config.yaml").write_text("mine: true\n")
    for overwrite in (False, True):
        with pytest.raises(RunDirError, match=r"holds .*config.yaml, which rallyrl did not write"):
            RunDir.check_start(tmp_path, _cfg(tmp_path, overwrite=overwrite), [])
    assert (tmp_path / "config.yaml").read_text() == "mine: true\n"


def test_overwrite_removes_exactly_rallyrls_files(tmp_path):
    run = tmp_path / "run"
    _fake_run(run)
    # the user's own files, beside and inside rallyrl's folders (an eval prompt file, notes)
    (run / "notes.txt").write_text("keep")
    (run / "prompts.txt").write_text("keep")
    with pytest.raises(RunDirError, match="already holds a run"):
        RunDir.check_start(run, _cfg(run), [])
    cfg = _cfg(run, overwrite=True)
    rd = RunDir.check_start(run, cfg, [0])
    rd.open(cfg, None, 0).close()
    assert (run / "notes.txt").read_text() == "keep" and (run / "prompts.txt").read_text() == "keep"
    assert not (run / "final").exists() and not (run / "eval").exists()
    assert (run / "metrics.jsonl").read_text() == ""  # a new, empty log
    assert set(json.loads((run / MANIFEST).read_text())["files"]) == {"config.yaml", "metrics.jsonl", "rollouts.jsonl"}


def test_a_user_folder_under_an_output_name_is_refused(tmp_path):
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "weights.bin").write_bytes(b"mine")
    with pytest.raises(RunDirError, match=r"final, which rallyrl did not write"):
        RunDir.check_start(tmp_path, _cfg(tmp_path, overwrite=True), [])
    (tmp_path / "eval").mkdir()  # a user's eval/ folder is fine, as long as no step file collides
    (tmp_path / "final" / "weights.bin").unlink()
    (tmp_path / "eval" / "step_0.jsonl").write_text("mine")
    with pytest.raises(RunDirError, match=r"step_0.jsonl, which rallyrl did not write"):
        RunDir.check_start(tmp_path, _cfg(tmp_path), [0, 5])


def test_a_run_that_completed_no_iteration_counts_as_empty(tmp_path):
    run = tmp_path / "run"
    _fake_run(run, steps=())  # failed in its first iteration: only the step-0 eval was written
    cfg = _cfg(run)
    rd = RunDir.check_start(run, cfg, [0])  # no overwrite needed
    rd.open(cfg, None, 0).close()
    assert not (run / "eval").exists()


def test_resume_with_a_changed_config_is_refused_then_recorded_when_allowed(tmp_path):
    run = tmp_path / "run"
    _fake_run(run)
    _fake_checkpoint(run, 2)
    changed = load_config({"train": {"run_dir": str(run), "resume": "latest", "iterations": 50},
                           "ppo": {"lr": 2e-3}, "rollout": {"num_rollouts": 32}})
    with pytest.raises(RunDirError) as e:
        RunDir.check_start(run, changed, [])
    msg = str(e.value)
    assert "ppo.lr: 0.001 -> 0.002" in msg and "rollout.num_rollouts: 64 -> 32" in msg
    assert "train.iterations" not in msg  # extending a run needs no permission
    allowed = load_config({**changed.to_dict(), "train": {**changed.to_dict()["train"], "allow_config_change": True}})
    rd = RunDir.check_start(run, allowed, [])
    original = (run / "config.yaml").read_text()
    rd.open(allowed, run / "checkpoints" / "step_2", 2).close()
    assert (run / "config.yaml").read_text() == original  # the original record is never rewritten
    (row,) = [json.loads(x) for x in (run / "config_history.jsonl").read_text().splitlines()]
    assert row["iteration"] == 2
    assert {c["key"]: (c["old"], c["new"]) for c in row["changes"]}["ppo.lr"] == (1e-3, 2e-3)
    # the recorded config now is the changed one: resuming again with it needs no permission
    assert rd.recorded_config()["ppo"]["lr"] == 2e-3 and yaml.safe_load(original)["ppo"]["lr"] == 1e-3
    RunDir.check_start(run, load_config({**allowed.to_dict(), "train": {**allowed.to_dict()["train"],
                                                                        "allow_config_change": False}}), [])


def test_resume_auto_starts_fresh_without_a_checkpoint(tmp_path):
    rd = RunDir.check_start(tmp_path / "new", _cfg(tmp_path / "new", resume="auto"), [])
    assert not rd.resuming
    run = tmp_path / "run"
    _fake_run(run)
    _fake_checkpoint(run, 2)
    assert RunDir.check_start(run, _cfg(run, resume="auto"), []).resuming


def test_the_manifest_is_read_once_and_on_disk_before_each_claimed_file(tmp_path, monkeypatch):
    """RunDir keeps the manifest in memory (one read), yet every claim is on disk before the claimed file
    exists: a run killed right after a claim leaves a manifest that lists it, so overwrite removes it."""
    run = tmp_path / "run"
    cfg = _cfg(run)
    rd = RunDir.check_start(run, cfg, [0, 1, 2])
    reads = []
    real_read = RunDir._read_manifest
    monkeypatch.setattr(RunDir, "_read_manifest", lambda self: reads.append(1) or real_read(self))
    w = rd.open(cfg, None, 0)
    for s in range(3):
        w.log_eval_samples(s, [{"index": s}])  # claims eval/ once and eval/step_<s>.jsonl each time
    rd.claim("final", is_dir=True)
    w.close()
    assert len(reads) == 1, reads  # the first look (open's clear_own), then never again
    on_disk = json.loads((run / MANIFEST).read_text())
    assert on_disk == rd._manifest()
    assert set(on_disk["files"]) == {"config.yaml", "metrics.jsonl", "rollouts.jsonl",
                                     *(f"eval/step_{s}.jsonl" for s in range(3))}
    assert set(on_disk["dirs"]) == {"eval", "final"}

    # crash safety: the claim is recorded on disk before the caller creates the file
    path = rd.claim("eval/step_9.jsonl")
    assert not path.exists() and "eval/step_9.jsonl" in json.loads((run / MANIFEST).read_text())["files"]
    # an unwritable manifest (here: its temporary file's name is taken by a folder) fails the claim and
    # leaves the in-memory copy as it was, equal to the file
    (run / (MANIFEST + ".tmp")).mkdir()
    with pytest.raises(OSError):
        rd.claim("eval/step_10.jsonl")
    assert rd._manifest() == json.loads((run / MANIFEST).read_text())
    assert "eval/step_10.jsonl" not in rd._manifest()["files"]


def test_sampled_text_with_unicode_line_breaks_stays_one_line_and_survives_truncation(tmp_path):
    """json.dumps(ensure_ascii=False) leaves U+0085 / U+2028 / U+2029 raw, and str.splitlines() splits
    on them: a sampled output holding one used to break rollouts.jsonl for resume's truncation."""
    cfg = _cfg(tmp_path / "run")
    rd = RunDir.check_start(tmp_path / "run", cfg, [])
    w = rd.open(cfg, None, 0)
    odd = "a\x85b\u2028c\u2029d\x1ce"
    w.log_rollouts([{"step": s, "output": odd} for s in (1, 2)])
    w.close()
    path = tmp_path / "run" / "rollouts.jsonl"
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 2 and [json.loads(x)["output"] for x in lines] == [odd, odd]
    rd.truncate_logs(1)
    assert [json.loads(x)["step"] for x in path.read_text(encoding="utf-8").splitlines()] == [1]


def test_the_old_import_paths_keep_working():
    """``rallyrl.tracking`` and ``rallyrl.checkpoint`` moved to ``rallyrl.run``; what users may have
    imported from them is the same object there."""
    import rallyrl.checkpoint as old_ckpt
    import rallyrl.run.checkpoint as ckpt
    import rallyrl.tracking as old
    from rallyrl.run import console, lock, logs, rundir

    assert old.RunDir is rundir.RunDir and old.RunLog is console.RunLog and old.TrainResult is console.TrainResult
    assert old.read_jsonl is logs.read_jsonl and old.RunDirBusyError is lock.RunDirBusyError
    assert old.releases_run_dir_lock is lock.releases_run_dir_lock and old.RunDirError is lock.RunDirError
    assert old_ckpt.verify_checkpoint is ckpt.verify_checkpoint and old_ckpt.load_checkpoint is ckpt.load_checkpoint
