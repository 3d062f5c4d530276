"""Exact resume after SIGKILL of every process mid-iteration, and a dead worker ending the job."""

import time

import pytest
import torch
from safetensors.torch import load_file

from rallyrl.run.logs import read_jsonl
from tests.helpers.runs import base_config, kill_when_paused, rallyrl_train, resume_latest, write_config

pytestmark = pytest.mark.dist


def _cfg(model, run_dir):
    return base_config(model, run_dir, train={"iterations": 4},
                       checkpoint={"interval": 1, "keep_last": 2},
                       ppo={"target_kl": 0.5, "reward_scaling": "running"},
                       reward={"fn": "tests.helpers.rewards:hashed_with_crashes"})


def test_resume_after_sigkill_is_bit_identical(tiny_model, tmp_path):
    # the reference: an uninterrupted 2-process run
    ref = rallyrl_train(write_config(tmp_path / "a.yaml", _cfg(tiny_model, tmp_path / "A")), 2)
    assert ref.returncode == 0, ref.stderr[-3000:]

    # the same run, with every process (CLI, launcher, both ranks) SIGKILLed in the middle of iteration
    # 3: 2 chunk rounds per iteration, so reward call 6 is the 2nd round of iteration 3
    cfg_b = write_config(tmp_path / "b.yaml", _cfg(tiny_model, tmp_path / "B"))
    cmd, e = kill_when_paused(cfg_b, 2, tmp_path / "calls", pause_at=6)
    ckpts = sorted(p.name for p in (tmp_path / "B" / "checkpoints").iterdir())
    assert ckpts == ["step_1", "step_2"], ckpts  # step_3 was never completed
    assert [m["step"] for m in read_jsonl(tmp_path / "B" / "metrics.jsonl")] == [1, 2]

    resume_latest(cmd, e)

    a = load_file(tmp_path / "A" / "final" / "model.safetensors")
    b = load_file(tmp_path / "B" / "final" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # logs continue without duplicate or missing steps, and are the uninterrupted run's logs
    ma, mb = read_jsonl(tmp_path / "A" / "metrics.jsonl"), read_jsonl(tmp_path / "B" / "metrics.jsonl")
    assert [m["step"] for m in mb] == [1, 2, 3, 4]
    strip = lambda m: {k: v for k, v in m.items() if not k.startswith("time/")}  # noqa: E731
    assert [strip(m) for m in ma] == [strip(m) for m in mb]
    assert read_jsonl(tmp_path / "A" / "rollouts.jsonl") == read_jsonl(tmp_path / "B" / "rollouts.jsonl")
    # keep_last=2
    assert sorted(p.name for p in (tmp_path / "B" / "checkpoints").iterdir()) == ["step_3", "step_4"]


@pytest.mark.parametrize("model_cfg, logprobs_from", [
    ({"reference": "lora", "lora": {"r": 4}}, "forward"),
    ({"reference": "shared", "num_layers_unfrozen": 1}, "generate"),
], ids=["lora", "shared-logprobs-from-generate"])
def test_resume_after_sigkill_is_bit_identical_for_lora_and_shared(tiny_model, tmp_path, model_cfg, logprobs_from):
    """The same guarantee with the references that share the policy's weights (LoRA: the adapter
    trains, the base is the reference; shared: frozen bottom block), on 2 processes; the shared case
    also takes the rollout log-probs from generation."""
    def cfg(run):
        c = _cfg(tiny_model, run)
        c["model"].update(model_cfg)
        c["rollout"]["logprobs_from"] = logprobs_from
        return c

    ref = rallyrl_train(write_config(tmp_path / "a.yaml", cfg(tmp_path / "A")), 2)
    assert ref.returncode == 0, ref.stderr[-3000:]
    cmd, e = kill_when_paused(write_config(tmp_path / "b.yaml", cfg(tmp_path / "B")), 2, tmp_path / "calls",
                              pause_at=6)
    assert [m["step"] for m in read_jsonl(tmp_path / "B" / "metrics.jsonl")] == [1, 2]
    resume_latest(cmd, e)
    a = load_file(tmp_path / "A" / "checkpoints" / "step_4" / "policy.safetensors")
    b = load_file(tmp_path / "B" / "checkpoints" / "step_4" / "policy.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    strip = lambda m: {k: v for k, v in m.items() if not k.startswith("time/")}  # noqa: E731
    ma, mb = read_jsonl(tmp_path / "A" / "metrics.jsonl"), read_jsonl(tmp_path / "B" / "metrics.jsonl")
    assert [strip(m) for m in ma] == [strip(m) for m in mb]
    assert ma[-1]["policy/kl"] != 0.0  # the policy moved away from its reference
    assert read_jsonl(tmp_path / "A" / "rollouts.jsonl") == read_jsonl(tmp_path / "B" / "rollouts.jsonl")


def _faulty_run(tiny_model, tmp_path, timeout_s: float, **fault_env: str) -> tuple[str, float]:
    """A 2-process run with `local` placement and a fault injected into one rank; it must fail."""
    cfg = base_config(tiny_model, tmp_path / "run", reward={"fn": "tests.helpers.rewards:hashed_with_crashes",
                                                           "placement": "local"},
                      dist={"timeout_s": timeout_s})
    t0 = time.monotonic()
    proc = rallyrl_train(write_config(tmp_path / "c.yaml", cfg), 2, **fault_env)
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0
    return proc.stdout + proc.stderr, elapsed


def test_dead_worker_ends_the_job_quickly_and_names_the_rank(tiny_model, tmp_path):
    text, elapsed = _faulty_run(tiny_model, tmp_path, 300.0, RALLYRL_TEST_KILL_RANK="1")
    assert elapsed < 90, elapsed  # far below the 300 s collective timeout: nobody waited for it
    assert "rank 1" in text or "rank: 1" in text, text[-3000:]
    assert "SIGKILL" in text or "Signals.SIGKILL" in text or "exitcode" in text, text[-3000:]
    # one line from the launcher, naming the killed rank, not the rank that only noticed it was gone
    assert "rallyrl: WorkerKilled: rank 1 was killed by SIGKILL" in text and "Traceback" not in text, text[-3000:]


def test_stuck_worker_is_bounded_by_the_collective_timeout(tiny_model, tmp_path):
    """A rank that hangs (alive, never reaching the next collective) holds its peers only for
    dist.timeout_s; then the job ends."""
    text, elapsed = _faulty_run(tiny_model, tmp_path, 5.0, RALLYRL_TEST_HANG_RANK="1")
    assert elapsed < 90, elapsed  # the hung rank would sleep 600 s
    assert "rank 0" in text or "rank: 0" in text or "rank      : 0" in text, text[-3000:]
    assert "imeout" in text or "imed out" in text, text[-3000:]
    # the waiting rank's one line, not a gloo traceback
    errors = [ln for ln in text.splitlines() if ln.startswith("rallyrl: ") and "Error" in ln]
    assert len(errors) == 1 and "Traceback" not in text, text[-3000:]
