"""Resume on another number of processes (issue 10 item 4): a 2-process checkpoint continues on 3 and on 1.

What must carry over is checked against the uninterrupted 2-process run: the LR schedule and the KL
controller at the first resumed iteration, the optimizer's step counters, the running reward moments' sample
count and the shared prompt sampler (the resumed iteration trains on the same global prompts). What is
re-derived (each rank's sampling and minibatch streams) makes the run differ, which the log and
config_history.jsonl say.
"""

import json
import shutil

import pytest
from safetensors.torch import load_file

import rallyrl
from rallyrl.run.logs import read_jsonl
from tests.helpers.runs import base_config, rallyrl_train, write_config

pytestmark = pytest.mark.dist

NOTICE = "the run continues from step 2 on {new} process{s} (was 2)"


def _cfg(model, run_dir, **train):
    # num_rollouts 7 splits 4/3 over 2 ranks, 3/2/2 over 3 and 7 over 1: every split allows 2 minibatches.
    # A long warm-up keeps the learning rate moving at every optimizer step (12 in the whole run), and a
    # short KL horizon moves the adaptive coefficient visibly, so a schedule or controller that restarted
    # would show in the first resumed iteration.
    return base_config(model, run_dir, train={"iterations": 3, **train},
                       checkpoint={"interval": 1, "keep_last": 3},
                       ppo={"target_kl": 0.5, "kl_horizon": 50, "reward_scaling": "running",
                            "lr_schedule": "constant", "warmup_steps": 16})


@pytest.fixture(scope="module")
def reference(tiny_model, tmp_path_factory):
    """The uninterrupted 2-process run (checkpoints after iterations 1, 2 and 3)."""
    tmp = tmp_path_factory.mktemp("wsize")
    proc = rallyrl_train(write_config(tmp / "a.yaml", _cfg(tiny_model, tmp / "A")), 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp / "A"


def _resume_on(nproc, reference, tiny_model, tmp_path, capfd):
    """Resume a copy of the reference run's step_2 (logs as a run killed during iteration 3 leaves them).
    One process runs in this process (cheaper than a launcher); more go through `rallyrl train --nproc`."""
    run = tmp_path / "B"
    shutil.copytree(reference, run, ignore=shutil.ignore_patterns("step_3", "final"))
    cfg = _cfg(tiny_model, run, resume="latest")
    if nproc == 1:
        rallyrl.train(cfg)
        return run, capfd.readouterr().err
    proc = rallyrl_train(write_config(tmp_path / "b.yaml", cfg), nproc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run, proc.stderr


def _state(run, step):
    return json.loads((run / "checkpoints" / f"step_{step}" / "trainer_state.json").read_text())


@pytest.mark.parametrize("nproc", [3, 1])
def test_resume_on_another_world_size_continues_the_run(nproc, reference, tiny_model, tmp_path, capfd):
    run, stderr = _resume_on(nproc, reference, tiny_model, tmp_path, capfd)

    # said once, on the main rank, with both process counts and that the run is not bit-identical
    notice = NOTICE.format(new=nproc, s="" if nproc == 1 else "es")
    assert stderr.count(notice) == 1, stderr[-3000:]
    assert "not bit-identical to an uninterrupted run" in stderr

    # metrics.jsonl continues at step 3; steps 1-2 are the reference run's rows
    ma, mb = read_jsonl(reference / "metrics.jsonl"), read_jsonl(run / "metrics.jsonl")
    assert [m["step"] for m in mb] == [1, 2, 3]
    assert mb[:2] == ma[:2]
    # the schedule and the KL controller continue where the checkpoint left them: the first resumed
    # iteration logs the reference's lr (after optimizer step 12 of the warm-up; a restarted schedule
    # would log 5/16 of the base lr, not 13/16) and its kl coefficient (the value saved after iteration 2)
    a3, b3 = ma[2], mb[2]
    assert b3["policy/lr"] == a3["policy/lr"] == pytest.approx(1e-3 * 13 / 16)
    assert b3["policy/kl_coef"] == a3["policy/kl_coef"] != ma[0]["policy/kl_coef"]
    assert b3["policy/optimizer_steps"] == a3["policy/optimizer_steps"] == 12

    # the same global prompts in the same global order as the uninterrupted run's iteration 3, split
    # over the new number of ranks (the shared sampler's position carried over)
    ra = [(r["index"], r["prompt"]) for r in read_jsonl(reference / "rollouts.jsonl") if r["step"] == 3]
    rb = read_jsonl(run / "rollouts.jsonl")
    assert [r["step"] for r in rb].count(3) == 7 and [r for r in rb if r["step"] < 3] == \
        [r for r in read_jsonl(reference / "rollouts.jsonl") if r["step"] < 3]
    assert sorted((r["index"], r["prompt"]) for r in rb if r["step"] == 3) == sorted(ra)
    assert {r["rank"] for r in rb if r["step"] == 3} == set(range(nproc))

    # the checkpoint the resumed run writes: its counters equal the uninterrupted run's
    sa, sb = _state(reference, 3), _state(run, 3)
    assert sb["world_size"] == nproc and sa["world_size"] == 2
    for key in ("iteration", "optimizer_steps", "sampler", "scheduler"):
        assert sb[key] == sa[key], key
    assert sb["reward_moments"]["count"] == sa["reward_moments"]["count"]
    oa = load_file(reference / "checkpoints" / "step_3" / "optimizer.safetensors")
    ob = load_file(run / "checkpoints" / "step_3" / "optimizer.safetensors")
    steps = [k for k in oa if k.endswith(".step")]
    assert steps and all(float(ob[k]) == float(oa[k]) == 12 for k in steps)  # Adam's counters carried over
    assert sorted(p.name for p in (run / "checkpoints" / "step_3").glob("rng_rank*.json")) == \
        [f"rng_rank{r}.json" for r in range(nproc)]

    # recorded in the run's history (and not replayed as a config change by a later resume)
    (row,) = [json.loads(x) for x in (run / "config_history.jsonl").read_text().splitlines()]
    assert row["iteration"] == 2 and row["checkpoint"].endswith("step_2")
    assert {c["key"] for c in row["changes"]} == {"train.run_dir", "train.resume"}  # the copy's, free to change
    assert row["world_size"] == {"old": 2, "new": nproc} and row["bit_identical"] is False
    assert (run / "final" / "model.safetensors").is_file()


def test_resume_on_a_world_size_the_batch_plan_does_not_fit_is_a_config_error(reference, tiny_model, tmp_path):
    """7 rollouts over 4 processes leave a rank 1 sample, fewer than ppo.num_minibatches=2: the launcher's
    usual check refuses before any worker starts (and before anything in the run dir changes)."""
    run = tmp_path / "B"
    shutil.copytree(reference, run)
    before = (run / "metrics.jsonl").read_text()
    proc = rallyrl_train(write_config(tmp_path / "b.yaml", _cfg(tiny_model, run, resume="latest")), 4)
    assert proc.returncode != 0
    assert "ppo.num_minibatches=2 exceeds the smallest per-rank batch (1 = rollout.num_rollouts 7 split over 4 " \
           "processes)" in proc.stderr, proc.stderr[-3000:]
    assert (run / "metrics.jsonl").read_text() == before and not (run / "config_history.jsonl").exists()
