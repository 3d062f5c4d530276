"""model.sharding: the config checks (pure, ms) and the byte counting behind memory/* (no process group)."""

from __future__ import annotations

import pytest
import torch

from rallyrl.config import ConfigError, load_config, make_batch_plan
from rallyrl.dist import local_nbytes


def test_default_is_ddp_and_fsdp_loads():
    assert load_config({}).model.sharding == "ddp"
    assert load_config({}, ["model.sharding=fsdp"]).model.sharding == "fsdp"
    with pytest.raises(ConfigError, match=r"model\.sharding: expected one of \['ddp', 'fsdp'\], got 'zero3'"):
        load_config({}, ["model.sharding=zero3"])


@pytest.mark.parametrize("reference", ["copy", "shared", "lora"])
def test_fsdp_takes_every_reference(reference):
    # shared and lora run the policy's own sharded LM; the rollout gathers it with them (dist.gathered)
    cfg = load_config({}, ["model.sharding=fsdp", f"model.reference={reference}"])
    assert (cfg.model.sharding, cfg.model.reference) == ("fsdp", reference)


def _plan(world_size: int, *overrides: str):
    return make_batch_plan(load_config({}, list(overrides)), world_size)


def test_fsdp_refuses_plans_where_ranks_run_different_micro_batch_counts():
    # 7 samples over 2 ranks = 4 + 3; 2 minibatches of (2, 2) and (2, 1); micro-batches of 1 -> [2, 2] vs [2, 1]
    args = ("rollout.num_rollouts=7", "ppo.num_minibatches=2", "ppo.micro_batch_size=1")
    with pytest.raises(ConfigError, match=r"model\.sharding=fsdp: with rollout\.num_rollouts=7 over 2 processes "
                                          r"\(4/3 samples per rank\).*\[2, 1\] vs \[2, 2\]"):
        _plan(2, "model.sharding=fsdp", *args)
    _plan(2, "model.sharding=ddp", *args)  # ddp synchronises only the last micro-batch: fine
    _plan(1, "model.sharding=fsdp", *args)  # one process: nothing is sharded
    # without micro-batches every rank runs one per minibatch; micro-batches of 2 give [1, 1] everywhere
    _plan(2, "model.sharding=fsdp", "rollout.num_rollouts=7", "ppo.num_minibatches=2")
    _plan(2, "model.sharding=fsdp", "rollout.num_rollouts=7", "ppo.num_minibatches=2", "ppo.micro_batch_size=2")
    _plan(2, "model.sharding=fsdp", "rollout.num_rollouts=8", "ppo.num_minibatches=2", "ppo.micro_batch_size=1")


def test_local_nbytes_counts_shared_storage_once():
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight  # tied, as GPT-2's head and input embeddings
    other = torch.zeros(3, dtype=torch.float64)
    assert local_nbytes([emb.weight, head.weight, other]) == 10 * 4 * 4 + 3 * 8
    assert local_nbytes([torch.zeros(0), torch.zeros(0)]) == 0
