"""model.sharding: fsdp on 2 processes (gloo, CPU): the same training as ddp within float tolerance, about
half the per-rank parameter + optimizer bytes, sharded (DCP) checkpoints with exact resume after SIGKILL,
and a final/ folder that plain transformers loads."""

import shutil

import pytest
import torch
from safetensors.torch import load_file

from rallyrl.run.logs import read_jsonl
from tests.helpers.runs import base_config, kill_when_paused, rallyrl_train, resume_latest, write_config

pytestmark = pytest.mark.dist

COMPARED = ("policy/loss", "value/loss", "policy/total_loss", "policy/grad_norm", "policy/kl", "policy/clipfrac",
            "policy/approx_kl", "reward/mean", "value/mean")


def _cfg(model, run_dir, sharding):
    # Greedy decoding: a rollout then depends on the weights only, not on a rank's random stream, which
    # lets the 2 -> 3 process resume below check the resharded weights through the samples they produce.
    cfg = base_config(model, run_dir, train={"iterations": 2}, checkpoint={"interval": 1, "keep_last": 2},
                      generation={"do_sample": False},
                      ppo={"target_kl": 0.5, "reward_scaling": "running", "max_grad_norm": 0.5},
                      reward={"fn": "tests.helpers.rewards:hashed_with_crashes"})
    cfg["model"]["sharding"] = sharding
    return cfg


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    """An uninterrupted ddp run and the same run with fsdp (2 iterations, 4 optimizer steps each)."""
    tmp = tmp_path_factory.mktemp("fsdp")
    out = {}
    for sharding in ("ddp", "fsdp"):
        cfg = _cfg(tiny_model, tmp / sharding, sharding)
        proc = rallyrl_train(write_config(tmp / f"{sharding}.yaml", cfg), 2)
        assert proc.returncode == 0, proc.stderr[-4000:]
        out[sharding] = tmp / sharding
    return out


def test_fsdp_trains_like_ddp_with_half_the_bytes_per_rank(runs):
    ddp, fsdp = read_jsonl(runs["ddp"] / "metrics.jsonl"), read_jsonl(runs["fsdp"] / "metrics.jsonl")
    assert [m["step"] for m in ddp] == [m["step"] for m in fsdp] == [1, 2]
    for a, b in zip(ddp, fsdp):
        for k in COMPARED:
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-5), (a["step"], k, a[k], b[k])
        # the clipping threshold is active, so the norms (of the whole gradient, over the shards) matter
        assert a["policy/grad_norm"] > 0.5
    # the same samples were generated (gathered weights are the whole weights)
    ra, rb = read_jsonl(runs["ddp"] / "rollouts.jsonl"), read_jsonl(runs["fsdp"] / "rollouts.jsonl")
    assert [(r["step"], r["index"], r["output"]) for r in ra] == [(r["step"], r["index"], r["output"]) for r in rb]
    # rank 0 holds about half of the parameters (policy + value head + reference) and optimizer state
    for a, b in zip(ddp, fsdp):
        assert a["memory/params_bytes"] > 0 and a["memory/optimizer_bytes"] > 0
        total_a = a["memory/params_bytes"] + a["memory/optimizer_bytes"]
        total_b = b["memory/params_bytes"] + b["memory/optimizer_bytes"]
        assert 0.4 < total_b / total_a < 0.6, (total_a, total_b)
        # AdamW: two moments per trained parameter (the reference is frozen)
        assert b["memory/optimizer_bytes"] < 0.6 * a["memory/optimizer_bytes"]


def test_fsdp_checkpoint_is_sharded_and_final_loads_with_transformers(runs, tiny_model):
    from transformers import AutoModelForCausalLM

    ckpt = runs["fsdp"] / "checkpoints" / "step_2"
    shards = sorted(p.name for p in (ckpt / "sharded").iterdir())
    assert shards == ["shard-00001-model-00001-of-00001.safetensors", "shard-00002-model-00001-of-00001.safetensors"]
    assert not (ckpt / "policy.safetensors").exists()
    # each rank wrote its own half (policy + value head weights and Adam moments: ~3 copies / 2 each)
    sizes = [(ckpt / "sharded" / s).stat().st_size for s in shards]
    full_weights = (runs["ddp"] / "checkpoints" / "step_2" / "policy.safetensors").stat().st_size
    assert all(1.2 * full_weights < s < 1.8 * full_weights for s in sizes), (sizes, full_weights)
    import json
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert set(manifest["files"]) >= {f"sharded/{s}" for s in shards}

    final = AutoModelForCausalLM.from_pretrained(runs["fsdp"] / "final")
    ddp_final = AutoModelForCausalLM.from_pretrained(runs["ddp"] / "final")
    a, b = ddp_final.state_dict(), final.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5, msg=k)
    initial = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    assert any(not torch.equal(initial[k], b[k]) for k in b)  # it trained
    # written once, tied as the input model (the head is the embedding matrix)
    saved = load_file(runs["fsdp"] / "final" / "model.safetensors")
    assert saved.keys() == load_file(runs["ddp"] / "final" / "model.safetensors").keys()


def test_fsdp_resume_after_sigkill_is_bit_identical(runs, tiny_model, tmp_path):
    cfg_b = write_config(tmp_path / "b.yaml", _cfg(tiny_model, tmp_path / "B", "fsdp"))
    # 2 chunk rounds per iteration: reward call 4 is the 2nd round of iteration 2 (after checkpoint 1)
    cmd, e = kill_when_paused(cfg_b, 2, tmp_path / "calls", pause_at=4)
    assert sorted(p.name for p in (tmp_path / "B" / "checkpoints").iterdir() if not p.name.startswith(".")) == \
        ["step_1"]

    resume_latest(cmd, e)

    a = load_file(runs["fsdp"] / "final" / "model.safetensors")
    b = load_file(tmp_path / "B" / "final" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    strip = lambda m: {k: v for k, v in m.items() if not k.startswith("time/")}  # noqa: E731
    ma, mb = read_jsonl(runs["fsdp"] / "metrics.jsonl"), read_jsonl(tmp_path / "B" / "metrics.jsonl")
    assert [strip(m) for m in ma] == [strip(m) for m in mb]
    # the resumed optimizer state is the uninterrupted run's: the last checkpoints are identical
    for name in ("shard-00001-model-00001-of-00001.safetensors", "shard-00002-model-00001-of-00001.safetensors"):
        sa = load_file(runs["fsdp"] / "checkpoints" / "step_2" / "sharded" / name)
        sb = load_file(tmp_path / "B" / "checkpoints" / "step_2" / "sharded" / name)
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa), name


def test_fsdp_resume_on_three_processes_reshards_weights_and_optimizer(runs, tiny_model, tmp_path):
    """The 2-process fsdp run's step_1 resumed on 3 processes: DCP reads each new rank's 1/3 slices out of
    the two shard files. Greedy decoding makes iteration 2's samples a function of the weights alone, so
    the same outputs as the uninterrupted run's iteration 2 show the weights were resharded exactly."""
    run = tmp_path / "B"
    shutil.copytree(runs["fsdp"], run, ignore=shutil.ignore_patterns("step_2", "final"))
    cfg = _cfg(tiny_model, run, "fsdp")
    cfg["train"]["resume"] = "latest"
    proc = rallyrl_train(write_config(tmp_path / "b.yaml", cfg), 3)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stderr.count("the run continues from step 1 on 3 processes (was 2)") == 1, proc.stderr[-3000:]

    ra = [r for r in read_jsonl(runs["fsdp"] / "rollouts.jsonl") if r["step"] == 2]
    rb = [r for r in read_jsonl(run / "rollouts.jsonl") if r["step"] == 2]
    assert {r["rank"] for r in rb} == {0, 1, 2}
    assert sorted((r["index"], r["output"]) for r in rb) == sorted((r["index"], r["output"]) for r in ra)
    ma, mb = read_jsonl(runs["fsdp"] / "metrics.jsonl"), read_jsonl(run / "metrics.jsonl")
    assert [m["step"] for m in mb] == [1, 2] and mb[0] == ma[0]
    # rollout-time statistics of iteration 2 (same weights, same samples; sums in another order) and
    # what the optimizer and schedule carried over
    for k in ("reward/mean", "policy/kl", "value/mean", "policy/response_length"):
        assert mb[1][k] == pytest.approx(ma[1][k], rel=1e-4, abs=1e-6), k
    assert mb[1]["policy/optimizer_steps"] == ma[1]["policy/optimizer_steps"] == 8
    assert mb[1]["policy/lr"] == ma[1]["policy/lr"]
    # 3 shards now: a third of the bytes per rank (rank 0 holds the rounded-up share)
    ckpt = run / "checkpoints" / "step_2"
    assert len(list((ckpt / "sharded").iterdir())) == 3
    assert 0.3 < mb[1]["memory/params_bytes"] / ma[1]["memory/params_bytes"] < 0.72
    assert 0.3 < mb[1]["memory/optimizer_bytes"] / ma[1]["memory/optimizer_bytes"] < 0.72
    # the Adam step counters carried over (4 steps per iteration)
    steps = [v for name in (ckpt / "sharded").iterdir() for k, v in load_file(name).items() if k.endswith(".step")]
    assert steps and all(float(v) == 8 for v in steps)


def test_fsdp_seq2seq_t5_guard_and_final(tmp_path):
    """seq2seq (tiny T5) under fsdp, with an infinite loss (a huge reward) in every optimizer step: the
    non-finite guard of Learner.step over sharded gradients skips every step on every rank, and the
    final/ folder assembled from the shards is exactly the initial model."""
    from transformers import AutoModelForSeq2SeqLM

    from rallyrl.dist import local_nbytes
    from rallyrl.testing import build_tiny_t5

    t5 = build_tiny_t5(tmp_path / "t5")
    cfg = base_config(t5, tmp_path / "run", train={"iterations": 1}, reward={"fn": "tests.helpers.rewards:huge"},
                      ppo={"max_nonfinite_skips": 100})
    cfg["model"].update(arch="seq2seq", sharding="fsdp")
    proc = rallyrl_train(write_config(tmp_path / "c.yaml", cfg), 2)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (m,) = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert m["policy/nonfinite_skips"] == 4 and m["policy/optimizer_steps"] == 0
    initial = AutoModelForSeq2SeqLM.from_pretrained(t5)
    # unsharded: the policy's LM + the reference's copy + the value head (H -> 1)
    whole = 2 * local_nbytes(initial.parameters()) + (initial.config.d_model + 1) * 4
    assert 0.45 < m["memory/params_bytes"] / whole < 0.55, (m["memory/params_bytes"], whole)
    final = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "run" / "final")
    a, b = initial.state_dict(), final.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_fsdp_with_logprobs_from_generate_matches_the_forward_pass(runs, tiny_model, tmp_path):
    """rollout.logprobs_from: generate under fsdp: the policy's log-probs and values come from the gathered
    generation, only the reference is gathered for the scoring pass; iteration 1 equals the fsdp run's
    (whose log-probs come from a separate forward) up to float rounding."""
    cfg = _cfg(tiny_model, tmp_path / "gen", "fsdp")
    cfg["rollout"]["logprobs_from"] = "generate"
    proc = rallyrl_train(write_config(tmp_path / "gen.yaml", cfg), 2)
    assert proc.returncode == 0, proc.stderr[-4000:]
    a, b = read_jsonl(runs["fsdp"] / "metrics.jsonl")[0], read_jsonl(tmp_path / "gen" / "metrics.jsonl")[0]
    for k in COMPARED:
        assert b[k] == pytest.approx(a[k], rel=1e-3, abs=1e-4), (k, a[k], b[k])
    outputs = [[r["output"] for r in read_jsonl(d / "rollouts.jsonl") if r["step"] == 1]
               for d in (runs["fsdp"], tmp_path / "gen")]
    assert outputs[0] == outputs[1]
