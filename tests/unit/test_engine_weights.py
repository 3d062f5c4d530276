"""What a separate engine is fed (rollout/vllm.py ``hf_weights``, no vLLM needed): a plain LM's parameters
under their Hugging Face names (a tied one under each name), and a LoRA policy's MERGED weights, equal to
peft's own ``merge_and_unload`` and computed without touching the trained tensors."""

import copy

import pytest
import torch

from rallyrl.config import ModelConfig
from rallyrl.models import load_models
from rallyrl.rollout.vllm import hf_weights


def test_plain_lm_gives_its_state_dict_names(tiny_model):
    lm = load_models(ModelConfig(path=str(tiny_model)), 0, value_head=False, reference=False).policy.lm
    got = dict(hf_weights(lm))
    sd = lm.state_dict()
    assert set(got) == {k for k, _ in lm.named_parameters(remove_duplicate=False)}
    assert torch.equal(got["lm_head.weight"], got["transformer.wte.weight"])  # tied: both names, one matrix
    assert all(torch.equal(got[k], sd[k]) for k in got)


def test_lora_gives_the_merged_weights_without_merging_in_place(tiny_model):
    pytest.importorskip("peft")
    from rallyrl.config import LoraConfig

    cfg = ModelConfig(path=str(tiny_model), reference="lora", lora=LoraConfig(r=4))
    lm = load_models(cfg, 0, value_head=False, reference=False).policy.lm
    with torch.no_grad():  # a trained adapter (B starts at 0, which would make the merge trivial)
        for name, p in lm.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    before = {k: v.clone() for k, v in lm.state_dict().items()}
    got = dict(hf_weights(lm))
    want = copy.deepcopy(lm).merge_and_unload().state_dict()
    assert set(got) >= set(want) - {"lm_head.weight"} and not any("lora_" in k or "base_layer" in k for k in got)
    for k, v in want.items():
        if k in got:
            assert torch.allclose(got[k], v, atol=1e-6), k
    changed = [k for k in want if "c_attn" in k and k.endswith("weight")]
    assert changed and all(not torch.equal(got[k], before[f"base_model.model.{k[:-len('weight')]}base_layer.weight"])
                           for k in changed)  # the adapter's delta is in what is pushed
    assert all(torch.equal(v, lm.state_dict()[k]) for k, v in before.items())  # the policy itself is untouched
