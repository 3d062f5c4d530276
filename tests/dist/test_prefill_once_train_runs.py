"""model.prefill_once in whole 2-process runs (gloo): under ddp, and under fsdp with activation
checkpointing (the prompt pass and the response pass are two forwards of the sharded LM inside one
policy forward; the blocks are recomputed in backward), GRPO with G = 4 and the KL in the loss (a copy
reference, scored once per distinct prompt too) trains as with it off: the same samples, metrics within
1e-4 and final weights within AdamW's amplification of fp32 rounding. (Under fsdp the policy runs the
two passes on every micro-batch, ``fixed_passes``, so ranks run as many block forwards.)"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from rallyrl.tracking import read_jsonl
from tests.helpers.runs import base_config, rallyrl_train, write_config

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("model", [{"sharding": "ddp"}, {"sharding": "fsdp", "gradient_checkpointing": True}],
                         ids=["ddp", "fsdp-ckpt"])
def test_prefill_once_trains_as_without_it(tiny_model, tmp_path, model):
    runs = {}
    for on in (True, False):
        # 2 prompts x G = 4 over 2 ranks, micro-batches of 2 rows: every forward over rollouts has a
        # repeated query. Sampled (greedy would give a group 4 equal answers, so zero advantages): the
        # same seed draws the same samples as long as the two runs' weights agree
        cfg = base_config(tiny_model, tmp_path / str(on), rollout={"num_rollouts": 8, "samples_per_prompt": 4,
                                                                   "chunk_size": 4},
                          ppo={"estimator": "grpo", "kl_in": "loss", "kl_estimator": "k3", "init_kl_coef": 0.1,
                               "num_minibatches": 1, "micro_batch_size": 2})
        cfg["model"].update(model, prefill_once=on)
        proc = rallyrl_train(write_config(tmp_path / f"{on}.yaml", cfg), 2)
        assert proc.returncode == 0, proc.stderr[-4000:]
        runs[on] = tmp_path / str(on)
    ra, rb = (read_jsonl(runs[on] / "rollouts.jsonl") for on in (True, False))
    assert [(r["step"], r["index"], r["output"]) for r in ra] == [(r["step"], r["index"], r["output"]) for r in rb]
    ma, mb = (read_jsonl(runs[on] / "metrics.jsonl") for on in (True, False))
    assert [m["step"] for m in ma] == [m["step"] for m in mb] == [1, 2]
    assert any(m["policy/loss"] != 0 for m in ma)  # something was learned
    for a, b in zip(ma, mb):
        for k in a:
            if not k.startswith(("time/", "memory/")):
                assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), (a["step"], k, a[k], b[k])
    wa, wb = (load_file(runs[on] / "final" / "model.safetensors") for on in (True, False))
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=2e-5)
