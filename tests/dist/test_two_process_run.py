"""A real 2-process run (gloo on CPU) with an odd num_rollouts: unequal shards (4 + 3)."""

import pytest

from rallyrl.run.logs import read_jsonl
from tests.helpers.rewards import deterministic_score
from tests.helpers.runs import base_config, rallyrl_train, write_config

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def two_proc_run(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dist2")
    cfg = base_config(tiny_model, tmp / "run")
    log = tmp / "calls.jsonl"
    proc = rallyrl_train(write_config(tmp / "c.yaml", cfg), 2, RALLYRL_TEST_CALL_LOG=str(log))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return tmp / "run", read_jsonl(log), proc


def test_every_sample_gets_its_own_reward(two_proc_run):
    run_dir, _, _ = two_proc_run
    rollouts = read_jsonl(run_dir / "rollouts.jsonl")
    for step in (1, 2):
        rows = [r for r in rollouts if r["step"] == step]
        assert sorted(r["index"] for r in rows) == list(range(7))
        # rank 0 holds global samples 0-3, rank 1 holds 4-6
        assert {r["index"] for r in rows if r["rank"] == 0} == {0, 1, 2, 3}
        assert {r["index"] for r in rows if r["rank"] == 1} == {4, 5, 6}
        for r in rows:
            assert r["reward"] == pytest.approx(deterministic_score(r["prompt"], r["output"]), abs=1e-6), r


def test_reward_runs_only_on_main_rank_once_per_chunk_round(two_proc_run):
    _, calls, _ = two_proc_run
    assert {c["rank"] for c in calls} == {0}
    # 4 and 3 samples with chunk_size 2 -> 2 chunk rounds of (2+2) and (2+1) samples; x 2 iterations
    # (plus evaluation: none configured)
    assert [c["n"] for c in calls] == [4, 3, 4, 3]


def test_metrics_equal_single_process_statistics(two_proc_run):
    """Global metrics computed over 2 ranks equal the plain statistics of all 7 samples."""
    run_dir, _, _ = two_proc_run
    rollouts = read_jsonl(run_dir / "rollouts.jsonl")
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        rows = [r for r in rollouts if r["step"] == m["step"]]
        rewards = [r["reward"] for r in rows]
        mean = sum(rewards) / len(rewards)
        std = (sum((x - mean) ** 2 for x in rewards) / (len(rewards) - 1)) ** 0.5
        assert m["reward/mean"] == pytest.approx(mean, rel=1e-6)
        assert m["reward/std"] == pytest.approx(std, rel=1e-5)
        assert m["policy/kl"] == pytest.approx(sum(r["kl"] for r in rows) / 7, rel=1e-4, abs=1e-6)
        assert m["reward/calls"] == 2 and m["reward/samples_per_call"] == pytest.approx(3.5)
    assert metrics[0]["policy/kl"] == 0.0


def test_final_model_written_once(two_proc_run):
    run_dir, _, _ = two_proc_run
    assert (run_dir / "final" / "config.json").is_file()
    assert (run_dir / "final" / "model.safetensors").is_file()
