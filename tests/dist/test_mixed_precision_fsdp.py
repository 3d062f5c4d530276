"""train.mixed_precision: bf16 under model.sharding: fsdp (FSDP2's MixedPrecisionPolicy) on 2 processes,
beside the same run under ddp (autocast): both train float32 weights, start at KL 0 and agree closely."""

import pytest
import torch
from safetensors.torch import load_file

from rallyrl.run.logs import read_jsonl
from tests.helpers.runs import base_config, rallyrl_train, write_config

pytestmark = pytest.mark.dist


def test_bf16_under_fsdp_and_ddp(tiny_model, tmp_path):
    out = {}
    for sharding in ("ddp", "fsdp"):
        cfg = base_config(tiny_model, tmp_path / sharding, generation={"do_sample": False}, rollout={"num_rollouts": 8})
        cfg["train"]["mixed_precision"] = "bf16"
        cfg["model"]["sharding"] = sharding
        proc = rallyrl_train(write_config(tmp_path / f"{sharding}.yaml", cfg), 2)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[sharding] = read_jsonl(tmp_path / sharding / "metrics.jsonl")
        weights = load_file(tmp_path / sharding / "final" / "model.safetensors")
        assert {t.dtype for t in weights.values()} == {torch.float32}
        assert out[sharding][0]["policy/kl"] == 0.0
    # the same greedy samples at step 1 and a close update (bf16 rounding differs between autocast and
    # FSDP's cast-once parameters)
    assert out["fsdp"][0]["reward/mean"] == out["ddp"][0]["reward/mean"]
    assert out["fsdp"][0]["policy/total_loss"] == pytest.approx(out["ddp"][0]["policy/total_loss"], abs=2e-2)
