"""model.gradient_checkpointing: the same gradients as without it, only the training forward is
checkpointed, and whole runs train the same."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import rallyrl
from rallyrl.config import LoraConfig, ModelConfig
from rallyrl.models import load_models
from rallyrl.models.base import transformer_blocks
from tests.helpers.sampling import sample
from tests.helpers.runs import base_config

pytestmark = pytest.mark.smoke


def _grads(model_path, checkpointing: bool, **model):
    torch.manual_seed(0)
    m = load_models(ModelConfig(path=str(model_path), gradient_checkpointing=checkpointing, value_head_std=0.1,
                                **model), seed=0)
    g = torch.Generator().manual_seed(1)
    q = torch.randint(5, 60, (3, 4), generator=g)
    r = torch.randint(5, 60, (3, 7), generator=g)
    qm, rm = torch.ones_like(q, dtype=torch.bool), torch.arange(7) < torch.tensor([[7], [3], [5]])
    qm[1, :2] = False  # left padding
    calls = {"n": 0}
    for block in transformer_blocks(m.policy):  # a recomputation calls the block's layers again
        next(block.children()).register_forward_hook(lambda *_: calls.__setitem__("n", calls["n"] + 1))
    logits, values = m.policy(q, qm, r, rm)
    loss = logits.float().logsumexp(-1).mul(rm).sum() + values.mul(rm).sum()
    loss.backward()
    return {n: p.grad.clone() for n, p in m.policy.named_parameters() if p.grad is not None}, calls["n"]


@pytest.mark.parametrize("model", [{}, {"reference": "lora", "lora": LoraConfig(r=4)}], ids=["full", "lora"])
def test_the_same_gradients_with_and_without(tiny_model, model):
    plain, n_plain = _grads(tiny_model, False, **model)
    ckpt, n_ckpt = _grads(tiny_model, True, **model)
    assert plain.keys() == ckpt.keys() and plain
    for k in plain:
        assert torch.allclose(plain[k], ckpt[k], rtol=1e-6, atol=1e-6), k
    # 2 blocks: each runs once in the forward and once more (recomputed) in the backward
    assert (n_plain, n_ckpt) == (2, 4)


def test_generation_is_not_checkpointed_and_a_run_trains_the_same(tiny_model, tmp_path):
    m = load_models(ModelConfig(path=str(tiny_model), gradient_checkpointing=True), seed=0)
    # generation has no gradients: the blocks run plainly (no checkpoint bookkeeping)
    out = sample(m.policy, m.tokenizer, [[5, 6, 7]], max_new_tokens=3, do_sample=False)
    assert len(out.token_ids[0]) == 3
    for name, on in (("plain", False), ("ckpt", True)):
        cfg = base_config(tiny_model, tmp_path / name)
        cfg["model"]["gradient_checkpointing"] = on
        rallyrl.train(cfg)
    a, b = (load_file(tmp_path / n / "final" / "model.safetensors") for n in ("plain", "ckpt"))
    assert all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-6) for k in a)
