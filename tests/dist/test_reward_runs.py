"""The central reward step in real training runs (`rallyrl train CONFIG --nproc N`, gloo on CPU).

Runs (each a few seconds of training on a tiny GPT-2):

- A-D, 2 processes, 7 rollouts = 4 + 3 per rank, chunk_size 3 -> chunk rounds of 3+3 and 1+0 samples
  (rank 1 has NO sample in round 2). A: `main`, a deterministic reward fn, batch_size 3. B: `main`, the
  same rewards from a fn that also draws from torch/numpy/random, no batch_size. C: `local`, drawing,
  batch_size 3, plus evaluation. D: `collective`, a "sharded" fn that runs a torch.distributed
  all-reduce (and draws), batch_size 3. The final weights must be byte-identical.
- E, 3 processes, 7 rollouts = 3/2/2, chunk 2 -> rounds 2/2/2 and 1/0/0: two weighted reward functions
  (the built-in hf_classifier on a locally built classifier + a dense per-token fn), `main`, with
  evaluation; the classifier is loaded by rank 0 only.
- F/G, 2 processes: the reward fn raises (`main`: on rank 0; `local`: on rank 1 only); with
  dist.timeout_s=300 both ranks raise the same RewardError, the launcher shows it once, naming the
  failing rank, and the run ends within seconds.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from rallyrl.run.logs import read_jsonl
from tests.helpers.rewards import build_tiny_classifier, deterministic_score
from tests.helpers.runs import base_config, rallyrl_train, write_config

pytestmark = pytest.mark.dist

PROMPTS = ["the cat", "a dog", "good morning", "what a", "i like", "the sun", "we walk", "birds sing",
           "my friend", "the rain"]
EVAL = [{"prompt": p, "expected_prompt": p, "id": f"e{i}"} for i, p in enumerate(["the", "a dog", "we"])]


def _prompts_file(tmp: Path) -> Path:
    path = tmp / "prompts.jsonl"  # metadata: the prompt again (alignment check) and an id (order check)
    path.write_text("".join(json.dumps({"prompt": p, "expected_prompt": p, "id": i}) + "\n"
                            for i, p in enumerate(PROMPTS)))
    return path


def _run(tmp: Path, name: str, nproc: int, model: Path, reward: dict, **sections):
    run_dir, log = tmp / name, tmp / f"{name}-calls.jsonl"
    cfg = base_config(model, run_dir, **sections)
    cfg["reward"] = reward  # replaces the default section
    cfg["dist"] = {"timeout_s": 300}
    t0 = time.perf_counter()
    proc = rallyrl_train(write_config(tmp / f"{name}.yaml", cfg), nproc, RALLYRL_TEST_CALL_LOG=str(log))
    wall = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr[-5000:]
    rows = read_jsonl(run_dir / "metrics.jsonl")
    # with evaluation on, the first row (step 0) is the evaluation of the initial policy
    if cfg["data"].get("eval_prompts"):
        assert rows[0]["step"] == 0
    return {"dir": run_dir, "calls": read_jsonl(log) if log.exists() else [], "wall": wall,
            "metrics": [m for m in rows if m["step"] >= 1], "rollouts": read_jsonl(run_dir / "rollouts.jsonl")}


@pytest.fixture(scope="module")
def placement_runs(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("placements")
    data = {"prompts": str(_prompts_file(tmp))}
    rollout = {"num_rollouts": 7, "chunk_size": 3}
    fn = "tests.helpers.rewards:"
    return {
        "A": _run(tmp, "A", 2, tiny_model, data=data, rollout=rollout,
                  reward={"fn": fn + "hashed", "placement": "main", "batch_size": 3}),
        "B": _run(tmp, "B", 2, tiny_model, data=data, rollout=rollout,
                  reward={"fn": fn + "hashed_noisy", "placement": "main"}),
        "C": _run(tmp, "C", 2, tiny_model, data={**data, "eval_prompts": EVAL}, rollout=rollout,
                  reward={"fn": fn + "hashed_noisy", "placement": "local", "batch_size": 3}),
        "D": _run(tmp, "D", 2, tiny_model, data=data, rollout=rollout,
                  reward={"fn": fn + "hashed_sharded", "placement": "collective", "batch_size": 3}),
    }


def test_training_is_bit_identical_across_placements_and_reward_randomness(placement_runs):
    """RNG isolation: the final weights are the same bytes whether the reward fn draws random numbers
    or not, and whichever placement scores it (and evaluation in C does not move them either)."""
    weights = {k: (r["dir"] / "final" / "model.safetensors").read_bytes() for k, r in placement_runs.items()}
    assert weights["A"] == weights["B"] == weights["C"] == weights["D"]
    strip = lambda rows: [(r["step"], r["index"], r["prompt"], r["output"], r["reward"]) for r in rows]
    assert strip(placement_runs["A"]["rollouts"]) == strip(placement_runs["D"]["rollouts"])
    # and training did something: the second iteration's samples differ from the first's
    outs = [[r["output"] for r in placement_runs["A"]["rollouts"] if r["step"] == s] for s in (1, 2)]
    assert outs[0] != outs[1]


def test_every_sample_gets_its_own_reward(placement_runs):
    for name, run in placement_runs.items():
        for step in (1, 2):
            rows = [r for r in run["rollouts"] if r["step"] == step]
            assert sorted(r["index"] for r in rows) == list(range(7)), name
            assert {r["index"] for r in rows if r["rank"] == 1} == {4, 5, 6}
            for r in rows:
                assert r["reward"] == pytest.approx(deterministic_score(r["prompt"], r["output"]), abs=1e-6)


def test_reward_calls_and_micro_batches_per_placement(placement_runs):
    """7 samples per iteration in rounds of 6 and 1. batch_size 3: main/collective 3 calls (3, 3, 1);
    local 3 calls (rank 0: 3, 1; rank 1: 3; none in round 2). No batch_size: 2 calls (6, 1)."""
    expected = {"A": (3, 7 / 3), "B": (2, 3.5), "C": (3, 7 / 3), "D": (3, 7 / 3)}
    for name, run in placement_runs.items():
        for m in run["metrics"]:
            assert (m["reward/calls"], m["reward/samples_per_call"]) == pytest.approx(expected[name]), name
            assert 0 < m["time/reward"] < m["time/rollout"]
            assert 0 < m["time/reward_gather"] < m["time/rollout"]
    train = {k: [c for c in r["calls"] if not str((c.get("ids") or [0])[0]).startswith("e")]
             for k, r in placement_runs.items()}
    sizes = lambda calls, rank: [c["n"] for c in calls if c["rank"] == rank]
    assert sizes(train["A"], 0) == [3, 3, 1] * 2 and sizes(train["A"], 1) == []  # main: rank 0 only
    assert sizes(train["B"], 0) == [6, 1] * 2 and sizes(train["B"], 1) == []
    assert sizes(train["C"], 0) == [3, 1] * 2 and sizes(train["C"], 1) == [3] * 2  # local: own samples
    assert sizes(train["D"], 0) == sizes(train["D"], 1) == [3, 3, 1] * 2  # collective: all, together


def _global_order(rollouts, step):
    """Ids in the order of the chunk rounds' global batches: round k = rank 0's k-th chunk, then rank
    1's k-th chunk (rank 0 holds samples 0-3, rank 1 holds 4-6; chunk_size 3)."""
    by_index = {r["index"]: PROMPTS.index(r["prompt"]) for r in rollouts if r["step"] == step}
    bounds = [(0, 4), (4, 7)]
    return [[by_index[i] for a, b in bounds for i in range(a + 3 * k, min(b, a + 3 * k + 3))] for k in (0, 1)]


def test_metadata_reaches_the_reward_fn_aligned_and_in_global_order(placement_runs):
    """(The reward fns also assert, in every call, that metadata `expected_prompt` == the prompt.)"""
    for name in ("A", "B", "D"):
        run = placement_runs[name]
        expected = [i for step in (1, 2) for rnd in _global_order(run["rollouts"], step) for i in rnd]
        for rank in ((0,) if name != "D" else (0, 1)):
            got = [i for c in run["calls"] if c["rank"] == rank for i in c["ids"]]
            assert got == expected, (name, rank)
    c = placement_runs["C"]  # local: each rank sees its own samples, in its own order
    train = [x for x in c["calls"] if not str(x["ids"][0]).startswith("e")]
    for rank, (a, b) in enumerate([(0, 4), (4, 7)]):
        got = [i for x in train if x["rank"] == rank for i in x["ids"]]
        exp = [PROMPTS.index(r["prompt"]) for s in (1, 2)
               for r in sorted((r for r in c["rollouts"] if r["step"] == s and a <= r["index"] < b),
                               key=lambda r: r["index"])]
        assert got == exp


def test_evaluation_uses_the_same_reward_step(placement_runs):
    c = placement_runs["C"]
    last = c["metrics"][-1]
    assert "eval/reward_mean" in last
    samples = read_jsonl(c["dir"] / "eval" / "step_2.jsonl")
    assert len(samples) == 3
    mean = sum(deterministic_score(s["prompt"], s["output"]) for s in samples) / 3
    assert last["eval/reward_mean"] == pytest.approx(mean, abs=1e-6)
    # placement `local` applies to evaluation too: 3 eval prompts = 2 + 1, each rank scores its own,
    # before training and after the last iteration
    ev = [x for x in c["calls"] if str(x["ids"][0]).startswith("e")]
    assert sorted((x["rank"], x["n"]) for x in ev) == [(0, 2), (0, 2), (1, 1), (1, 1)]


# ------------------------------------------------------------------------------------------------
# E: hf_classifier + a dense reward, weighted, 3 processes, main placement


@pytest.fixture(scope="module")
def classifier_run(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("clf3")
    # ~25M parameters (~100 MB): big enough to see in a process's peak RSS
    clf = build_tiny_classifier(tmp / "clf", tiny_model, n_embd=512, n_layer=8)
    loads = tmp / "loads"
    loads.mkdir()
    reward = {"placement": "main", "batch_size": 4, "fns": [
        {"fn": "tests.helpers.rewards:counted_classifier", "weight": 0.5, "name": "clf",
         "kwargs": {"log_dir": str(loads), "path": str(clf), "label": "POS", "device": "cpu"}},
        {"fn": "tests.helpers.rewards:dense_ramp", "weight": 2.0, "name": "dense"}]}
    run = _run(tmp, "E", 3, tiny_model, data={"eval_prompts": ["the", "a dog", "we"]},
               rollout={"num_rollouts": 7, "chunk_size": 2}, reward=reward)
    run["clf"] = clf
    run["ranks"] = {int(p.stem[4:]): json.loads(p.read_text()) for p in loads.glob("rank*.json")}
    return run


def test_only_the_main_rank_loads_the_reward_model(classifier_run):
    ranks = classifier_run["ranks"]
    assert sorted(ranks) == [0, 1, 2]
    # rank 0: one load; 2 iterations x (2 + 1 micro-batches) + 2 evaluations x 1 = 8 calls
    assert (ranks[0]["loads"], ranks[0]["calls"], ranks[0]["model_loaded"]) == (1, 8, True)
    for r in (1, 2):
        assert (ranks[r]["loads"], ranks[r]["calls"], ranks[r]["model_loaded"]) == (0, 0, False)
    model_mb = (classifier_run["clf"] / "model.safetensors").stat().st_size / 2**20
    rss_mb = {r: ranks[r]["maxrss_kb"] / 1024 for r in ranks}
    print(f"\nreward model {model_mb:.0f} MiB; peak RSS per rank (MiB): "
          + ", ".join(f"rank {r}: {v:.0f}" for r, v in sorted(rss_mb.items())))
    # the difference is the reward model (loose bound: a correctness check, not a benchmark)
    assert rss_mb[0] - max(rss_mb[1], rss_mb[2]) > 0.5 * model_mb


def test_weighted_reward_functions_and_dense_rewards_end_to_end(classifier_run):
    from rallyrl.reward import hf_classifier

    clf = hf_classifier(str(classifier_run["clf"]), label="POS")
    for m in classifier_run["metrics"]:
        rows = [r for r in classifier_run["rollouts"] if r["step"] == m["step"]]
        assert sorted(r["index"] for r in rows) == list(range(7))
        scores = clf([r["prompt"] + r["output"] for r in rows], [r["prompt"] for r in rows],
                     [r["output"] for r in rows])
        dense = [deterministic_score(r["prompt"], r["output"]) for r in rows]  # sum of each dense list
        for r, c, d in zip(rows, scores, dense):
            assert r["reward"] == pytest.approx(0.5 * c + 2.0 * d, abs=1e-4)
        # reward/<name> is each function's own mean; reward/mean is their weighted sum
        assert m["reward/clf"] == pytest.approx(sum(scores) / 7, abs=1e-4)
        assert m["reward/dense"] == pytest.approx(sum(dense) / 7, abs=1e-5)
        assert m["reward/mean"] == pytest.approx(0.5 * m["reward/clf"] + 2.0 * m["reward/dense"], abs=1e-5)
        # 2 functions x (round 1: 6 samples -> 4 + 2; round 2: 1/0/0 -> 1) = 6 calls of 14 samples
        assert m["reward/calls"] == 6 and m["reward/samples_per_call"] == pytest.approx(14 / 6)
    assert "eval/reward_mean" in classifier_run["metrics"][-1]


# ------------------------------------------------------------------------------------------------
# F/G: failure is collective and fast


@pytest.mark.parametrize("placement,failing_rank,estimator", [("main", 0, "gae"), ("local", 1, "gae"),
                                                                ("local", 1, "grpo")])
def test_a_failing_reward_fn_ends_every_rank_within_seconds(tiny_model, tmp_path, placement, failing_rank, estimator):
    groups = {"rollout": {"num_rollouts": 8, "samples_per_prompt": 4}} if estimator != "gae" else {}
    cfg = base_config(tiny_model, tmp_path / "run", reward={
        "fn": "tests.helpers.rewards:make_failing", "placement": placement,
        "kwargs": {"on_rank": failing_rank, "message": "reward model exploded", "stamp_dir": str(tmp_path)}},
        ppo={"estimator": estimator}, **groups)
    cfg["dist"] = {"timeout_s": 300}  # a rank left waiting in a collective would hang for 5 minutes
    t0 = time.time()
    proc = rallyrl_train(write_config(tmp_path / "c.yaml", cfg), 2, timeout=120)
    end = time.time()
    raised = json.loads((tmp_path / "raised.json").read_text())
    print(f"\n{placement}: run {end - t0:.1f} s, exit {end - raised['time']:.1f} s after the reward fn raised")
    assert proc.returncode == 1
    assert end - t0 < 60 and end - raised["time"] < 30
    # Every rank raised the same RewardError; the launcher shows it once, naming the rank where the
    # reward failed (not a healthy rank), without a traceback (RALLYRL_DEBUG=1 would add them).
    expected = (f"rallyrl: RewardError: reward step failed on rank {failing_rank}: ValueError: reward model "
                f"exploded (rank {failing_rank})")
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("rallyrl: ") and "Error" in ln]
    assert errors == [expected], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
