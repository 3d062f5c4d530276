"""Checkpoint contents, atomicity, validation of corrupt checkpoints, and single-process exact resume."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

import rallyrl
from rallyrl.errors import CheckpointError
from rallyrl.run.checkpoint import join_tensors, newest_valid, resolve_resume, split_tensors, verify_checkpoint
from rallyrl.run.logs import read_jsonl
from tests.helpers.runs import base_config, killed_run_copy

pytestmark = pytest.mark.smoke


@pytest.fixture(scope="module")
def run(tiny_model, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ckpt") / "run"
    cfg = base_config(tiny_model, run_dir, train={"iterations": 3}, checkpoint={"interval": 1, "keep_last": 2},
                      ppo={"target_kl": 1.0})
    rallyrl.train(cfg)
    return run_dir, cfg


def test_checkpoint_layout_and_keep_last(run):
    run_dir, _ = run
    root = run_dir / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_2", "step_3"]
    files = sorted(p.name for p in (root / "step_3").iterdir())
    assert files == ["manifest.json", "optimizer.json", "optimizer.safetensors", "policy.safetensors",
                     "rng_rank0.json", "rng_rank0.safetensors", "trainer_state.json"]
    # nothing that would need unpickling
    assert all(f.endswith((".json", ".safetensors")) for f in files)
    state = json.loads((root / "step_3" / "trainer_state.json").read_text())
    assert state["iteration"] == 3 and state["optimizer_steps"] == 3 * 2 * 2
    assert set(state) >= {"kl_ctl", "reward_moments", "sampler", "scheduler", "world_size"}
    weights = load_file(root / "step_3" / "policy.safetensors")
    assert any(k.startswith("v_head") for k in weights)  # value head is in the checkpoint
    assert verify_checkpoint(root / "step_3")["step"] == 3


def _copy(run_dir, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(run_dir, dst)
    return dst


def test_truncated_file_is_refused_and_latest_falls_back(run, tmp_path):
    run_dir = _copy(run[0], tmp_path)
    bad = run_dir / "checkpoints" / "step_3" / "policy.safetensors"
    bad.write_bytes(bad.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"step_3.*policy\.safetensors.*truncated"):
        verify_checkpoint(bad.parent)
    assert resolve_resume(run_dir, "latest").name == "step_2"
    newest, problems = newest_valid(run_dir / "checkpoints")
    assert newest.name == "step_2" and [p.name for p, _ in problems] == ["step_3"] and "truncated" in problems[0][1]
    assert newest_valid(run_dir / "checkpoints", checksums=False)[0].name == "step_2"  # a size is checked without
    with pytest.raises(CheckpointError, match="policy.safetensors"):
        resolve_resume(run_dir, str(bad.parent))  # an explicit path is never silently replaced


def test_checksum_mismatch_and_missing_files(run, tmp_path):
    run_dir = _copy(run[0], tmp_path)
    step3 = run_dir / "checkpoints" / "step_3"
    data = bytearray((step3 / "optimizer.safetensors").read_bytes())
    data[-1] ^= 0xFF  # same size, different content
    (step3 / "optimizer.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"checksum mismatch in optimizer\.safetensors"):
        verify_checkpoint(step3)
    step2 = run_dir / "checkpoints" / "step_2"
    (step2 / "rng_rank0.json").unlink()
    with pytest.raises(CheckpointError, match=r"incomplete: rng_rank0\.json is missing"):
        verify_checkpoint(step2)
    (step2 / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="manifest.json is missing"):
        verify_checkpoint(step2)
    with pytest.raises(CheckpointError, match=r"no valid checkpoint in .*checksum mismatch.*manifest.json is missing"):
        resolve_resume(run_dir, "latest")
    # the quick look (sizes, no checksums) takes step_3 for valid: only reading it whole finds the mismatch
    assert newest_valid(run_dir / "checkpoints", checksums=False)[0].name == "step_3"


def test_leftover_tmp_folder_is_ignored(run, tmp_path):
    run_dir = _copy(run[0], tmp_path)
    (run_dir / "checkpoints" / ".tmp_step_4").mkdir()  # a save interrupted by a crash
    assert resolve_resume(run_dir, "latest").name == "step_3"


def test_resume_continues_to_the_same_weights(run, tiny_model, tmp_path):
    """Resume from step 2 of the reference run into a fresh run dir: same final weights, same logs."""
    run_dir, cfg = run
    resumed = killed_run_copy(run_dir, tmp_path / "resumed", 2)  # step 3+ logged, never checkpointed
    cfg2 = base_config(tiny_model, resumed, train={"iterations": 3, "resume": "latest"},
                       checkpoint={"interval": 1, "keep_last": 2}, ppo={"target_kl": 1.0})
    rallyrl.train(cfg2)
    a = load_file(run_dir / "final" / "model.safetensors")
    b = load_file(resumed / "final" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [m["step"] for m in read_jsonl(resumed / "metrics.jsonl")] == [1, 2, 3]
    assert read_jsonl(resumed / "rollouts.jsonl") == read_jsonl(run_dir / "rollouts.jsonl")


def test_resume_with_another_world_size_continues_and_says_so(run, tiny_model, tmp_path, capsys):
    """A consistent checkpoint that says 2 processes resumes on 1 (the real 2 -> 3 and 2 -> 1 runs are in
    tests/dist/test_resume_world_size.py); an edit the manifest does not know is still refused."""
    import hashlib

    run_dir, _ = run
    step = tmp_path / "r" / "checkpoints" / "step_2"
    shutil.copytree(run_dir / "checkpoints" / "step_2", step)
    state = json.loads((step / "trainer_state.json").read_text())
    state["world_size"] = 2
    (step / "trainer_state.json").write_text(json.dumps(state))
    with pytest.raises(CheckpointError, match="trainer_state.json"):
        verify_checkpoint(step)  # the manifest catches the edit...
    manifest = json.loads((step / "manifest.json").read_text())
    data = (step / "trainer_state.json").read_bytes()
    manifest["files"]["trainer_state.json"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (step / "manifest.json").write_text(json.dumps(manifest))
    cfg = base_config(tiny_model, tmp_path / "r", train={"iterations": 3, "resume": "latest"},
                      ppo={"target_kl": 1.0})
    rallyrl.train(cfg)  # ...and a consistent one from another world size continues
    assert capsys.readouterr().err.count("the run continues from step 2 on 1 process (was 2)") == 1
    assert [m["step"] for m in read_jsonl(tmp_path / "r" / "metrics.jsonl")] == [3]
    (row,) = read_jsonl(tmp_path / "r" / "config_history.jsonl")
    assert row["world_size"] == {"old": 2, "new": 1} and row["bit_identical"] is False


def test_split_join_roundtrip_keeps_types():
    obj = {"state": {0: {"step": torch.tensor(3.0), "m": torch.ones(2)}}, "groups": [{"lr": 1e-3, "params": [0]}],
           "py": (3, [1, 2], None)}
    meta, tensors = split_tensors(obj)
    json.dumps(meta)  # JSON-able
    back = join_tensors(json.loads(json.dumps(meta)), tensors)
    assert list(back["state"]) == [0] and torch.equal(back["state"][0]["m"], torch.ones(2))
    assert back["groups"] == [{"lr": 1e-3, "params": [0]}] and back["py"] == (3, [1, 2], None)


def test_a_full_disk_while_saving_is_one_line_and_keeps_the_last_checkpoint(tiny_model, tmp_path, capsys,
                                                                           monkeypatch):
    """A real run whose second checkpoint write fails the way safetensors reports ENOSPC: one line (the
    path, the OS reason, the hint), exit 2, no traceback; step_1 stays the newest complete checkpoint."""
    from safetensors import SafetensorError

    import rallyrl.run.checkpoint as ckpt
    from rallyrl.cli import main
    from tests.helpers.runs import write_config

    calls = []
    real_save_model = ckpt.save_model

    def save_model(model, filename):
        calls.append(filename)
        if len(calls) == 2:
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real_save_model(model, filename)

    monkeypatch.setattr(ckpt, "save_model", save_model)
    run_dir = tmp_path / "run"
    cfg = write_config(tmp_path / "c.yaml", base_config(tiny_model, run_dir, train={"iterations": 3},
                                                        checkpoint={"interval": 1}))
    assert main(["train", str(cfg)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    tmp = run_dir / "checkpoints" / ".tmp_step_2"
    assert err[-1] == (f"rallyrl: error: saving checkpoint {run_dir / 'checkpoints' / 'step_2'}: cannot write {tmp}: "
                       f"No space left on device (ENOSPC); free space on that file system (or raise the quota), or "
                       f"point train.run_dir to one with room; the last complete checkpoint is intact"), err
    assert not any("Traceback" in line or "safetensors" in line for line in err)
    assert [p.name for p in ckpt.list_checkpoints(run_dir / "checkpoints")] == ["step_1"]
    ckpt.verify_checkpoint(run_dir / "checkpoints" / "step_1")


def test_time_based_checkpoints_in_a_real_run(tiny_model, tmp_path):
    """checkpoint.interval_minutes (the default way: 30) with a tiny interval: a checkpoint after every
    iteration, bounded by keep_last; resumable like any other."""
    run_dir = tmp_path / "run"
    cfg = base_config(tiny_model, run_dir, train={"iterations": 3},
                      checkpoint={"interval": 0, "interval_minutes": 1e-6, "keep_last": 2})
    rallyrl.train(cfg)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_2", "step_3"]
    verify_checkpoint(run_dir / "checkpoints" / "step_3")
