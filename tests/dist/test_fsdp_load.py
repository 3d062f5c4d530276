"""model.sharding: fsdp loads straight into shards (models/weights.py, dist.shard(weights=...)): every rank
builds the model empty, and rank 0 alone reads the weights and sends each rank its shards. On 2
processes the run is bit-identical to the same run loading the old way (whole on every rank, then
sharded): every logged metric of both iterations, the samples and final/."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from rallyrl.run.logs import read_jsonl
from tests.helpers.runs import ROOT, base_config, env, write_config

pytestmark = pytest.mark.dist

NOTE = "rallyrl: note: model.sharding: fsdp: every rank loads the whole model before sharding it"


def _run(cfg, tmp, name, **extra_env):
    out = tmp / f"{name}_ranks"
    out.mkdir()
    cfg = {**cfg, "train": {**cfg["train"], "run_dir": str(tmp / name)}}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / "helpers" / "train_worker.py"), str(write_config(tmp / f"{name}.yaml", cfg)), str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env(**extra_env))
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["ok"] for r in ranks] == [True, True], (ranks, proc.stderr[-3000:])
    return tmp / name, proc.stderr


@pytest.mark.parametrize("case", ["gpt2-ppo-checkpointing-bf16", "llama-grpo-no-reference-bfloat16"])
def test_loading_into_shards_trains_exactly_as_loading_whole(case, tiny_model, tiny_llama, tmp_path):
    if case.startswith("gpt2"):
        # tied head, value head, copy reference, activation checkpointing, bf16 compute
        cfg = base_config(tiny_model, tmp_path, train={"iterations": 2, "mixed_precision": "bf16"})
        cfg["model"].update(sharding="fsdp", gradient_checkpointing=True, value_head="mlp")
    else:
        # untied head, rotary inv_freq (a non-persistent buffer), no value head and no reference, float32
        # files held in bfloat16
        cfg = base_config(tiny_llama, tmp_path, train={"iterations": 2},
                          rollout={"num_rollouts": 8, "samples_per_prompt": 2},
                          ppo={"estimator": "grpo", "init_kl_coef": 0.0})
        cfg["model"].update(sharding="fsdp", dtype="bfloat16")
    new, new_err = _run(cfg, tmp_path, "shards")
    old, old_err = _run(cfg, tmp_path, "whole", RALLYRL_TEST_FULL_LOAD="1")
    assert NOTE not in new_err and f"{NOTE}: RALLYRL_TEST_FULL_LOAD" in old_err
    strip = lambda rows: [{k: v for k, v in m.items() if not k.startswith("time/")} for m in rows]  # noqa: E731
    a, b = strip(read_jsonl(old / "metrics.jsonl")), strip(read_jsonl(new / "metrics.jsonl"))
    assert [m["step"] for m in b] == [1, 2]
    assert a == b
    assert a[0].get("policy/kl", 0.0) == 0.0  # the reference starts as the policy (when there is one)
    key = lambda r: (r["step"], r["index"], r["output"], r["reward"])  # noqa: E731
    assert [key(r) for r in read_jsonl(old / "rollouts.jsonl")] == [key(r) for r in read_jsonl(new / "rollouts.jsonl")]
    fa, fb = load_file(old / "final" / "model.safetensors"), load_file(new / "final" / "model.safetensors")
    assert fa.keys() == fb.keys() and all(torch.equal(fa[k], fb[k]) for k in fa)


def test_rank_0_failing_to_read_the_weights_fails_every_rank_with_its_error(tiny_model, tmp_path):
    """Rank 0 alone reads the files; when that fails, the other rank must not sit in the broadcast
    waiting for it: every rank raises the same ModelWeightsError, carrying rank 0's OS error, and nothing
    was trained."""
    cfg = base_config(tiny_model, tmp_path / "run")
    cfg["model"]["sharding"] = "fsdp"
    out = tmp_path / "ranks"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / "helpers" / "train_worker.py"), str(write_config(tmp_path / "c.yaml", cfg)), str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=env(RALLYRL_TEST_UNREADABLE_WEIGHTS="1"))
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["type"] for r in ranks] == ["ModelWeightsError"] * 2, (ranks, proc.stderr[-3000:])
    assert ranks[0]["message"] == ranks[1]["message"]
    assert "on rank 0" in ranks[0]["message"] and "Input/output error" in ranks[0]["message"]
    assert "model.safetensors" in ranks[0]["message"]
    assert max(r["end"] - r["start"] for r in ranks) < 60  # no rank waited for a collective timeout
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not read_jsonl(tmp_path / "run" / "metrics.jsonl")
