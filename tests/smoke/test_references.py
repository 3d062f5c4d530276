"""`model.reference: copy | shared | lora` on tiny local GPT-2 and Llama models: what trains, that the
reference never moves, first-iteration KL 0, exact resume, final/ contents and the errors."""

import pytest
import torch
from safetensors.torch import load_file

import rallyrl
from rallyrl import dist, ops
from rallyrl.config import ConfigError, PPOConfig, load_config
from rallyrl.models import load_models
from rallyrl.learn.state import Learner
from rallyrl.run.logs import read_jsonl
from tests.helpers.runs import base_config, killed_run_copy

pytestmark = pytest.mark.smoke


CASES = {  # id -> (model fixture, model.* settings)
    "copy": ("tiny_model", {"reference": "copy"}),
    "shared-gpt2": ("tiny_model", {"reference": "shared", "num_layers_unfrozen": 1}),
    "shared-gpt2-all": ("tiny_model", {"reference": "shared", "num_layers_unfrozen": 2}),
    "shared-llama": ("tiny_llama", {"reference": "shared", "num_layers_unfrozen": 1}),
    "lora": ("tiny_model", {"reference": "lora", "lora": {"r": 4}}),
}


def _cfg(model, run_dir, model_cfg, **sections):
    cfg = base_config(model, run_dir, **sections)
    cfg["model"].update(model_cfg)
    return cfg


def _batch(tok, device="cpu"):
    """A left-padded query batch and right-padded responses (fixed tokens, so log-probs are comparable)."""
    q = tok(["the cat sat", "a dog"], return_tensors="pt", padding=True)
    g = torch.Generator().manual_seed(0)
    resp = torch.randint(1, len(tok), (2, 5), generator=g)
    rmask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)
    return q.input_ids, q.attention_mask.bool(), resp, rmask


@pytest.mark.parametrize("case", list(CASES))
def test_reference_is_frozen_while_the_policy_learns(case, request):
    fixture, model_cfg = CASES[case]
    model = request.getfixturevalue(fixture)
    cfg = load_config({"model": {"path": str(model), **model_cfg}})
    torch.manual_seed(0)
    m = load_models(cfg.model, seed=0)
    policy, ref = m.policy, m.reference
    q, qm, r, rm = _batch(m.tokenizer)
    trainable = [n for n, p in policy.named_parameters() if p.requires_grad]
    dist.init_accelerator(60)  # world size 1: the Learner's optimizer step as in training
    learner = Learner.create(policy, PPOConfig(lr=1e-2), total_steps=10)
    held = [p for g in learner.optimizer.param_groups for p in g["params"]]
    # the optimizer holds exactly the trainable parameters
    assert len(held) == len(trainable) and all(p.requires_grad for p in held)
    # the reference owns only frozen weights (none of the policy's trainable ones, not even as a submodule)
    trainable_ids = {id(p) for p in policy.parameters() if p.requires_grad}
    assert not any(p.requires_grad or id(p) in trainable_ids for p in ref.parameters())
    frozen_before = {n: p.detach().clone() for n, p in policy.named_parameters() if not p.requires_grad}
    with torch.no_grad():
        lp0 = ops.logprobs_from_logits(policy(q, qm, r, rm)[0], r)
    ref0 = ref.logprobs(q, qm, r, rm, 1.0)
    # before any update the reference is the policy (so the first KL is exactly 0)
    assert torch.equal(ref0 * rm, lp0 * rm) or torch.allclose(ref0 * rm, lp0 * rm, atol=1e-6, rtol=0)
    old_lp = lp0.detach()
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0, 1.0], [-1.0, 1.0, -1.0, 0.0, 0.0]])
    for _ in range(4):  # PPO policy-loss updates through the guarded optimizer step
        learner.optimizer.zero_grad(set_to_none=True)
        logits, values = learner.model(q, qm, r, rm)
        pg, _ = ops.policy_loss(ops.logprobs_from_logits(logits, r), old_lp, adv, rm, 0.2, rm.sum())
        loss = pg + (values * rm).pow(2).sum() / rm.sum()
        loss.backward()
        assert learner.step(loss.detach()) is not None
    with torch.no_grad():
        lp1 = ops.logprobs_from_logits(policy(q, qm, r, rm)[0], r)
    assert not torch.allclose(lp1 * rm, lp0 * rm, atol=1e-4), "the policy did not change"
    assert torch.equal(ref.logprobs(q, qm, r, rm, 1.0), ref0), "the reference moved"
    for n, p in policy.named_parameters():  # nothing frozen moved
        if n in frozen_before:
            assert torch.equal(p, frozen_before[n]), n
    if model_cfg["reference"] == "shared":
        assert not any("wte" in n or "wpe" in n or "embed_tokens" in n for n in trainable)
        assert any(".0." in n for n in trainable) == (model_cfg["num_layers_unfrozen"] == 2)
    if model_cfg["reference"] == "lora":
        assert trainable and all("lora_" in n or n.startswith("v_head") for n in trainable)


@pytest.mark.parametrize("case", ["shared-gpt2", "shared-llama", "lora"])
def test_first_kl_is_zero_and_resume_is_exact(case, request, tmp_path):
    fixture, model_cfg = CASES[case]
    model = request.getfixturevalue(fixture)
    full = tmp_path / "full"
    kw = dict(train={"iterations": 3}, checkpoint={"interval": 1, "keep_last": 3})
    rallyrl.train(_cfg(model, full, model_cfg, **kw))
    metrics = read_jsonl(full / "metrics.jsonl")
    assert metrics[0]["policy/kl"] == 0.0
    assert metrics[-1]["policy/kl"] != 0.0  # the policy did move away from the reference
    resumed = killed_run_copy(full, tmp_path / "resumed", 1)
    kw["train"] = {"iterations": 3, "resume": "latest"}
    rallyrl.train(_cfg(model, resumed, model_cfg, **kw))
    a = load_file(full / "checkpoints" / "step_3" / "policy.safetensors")
    b = load_file(resumed / "checkpoints" / "step_3" / "policy.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert read_jsonl(resumed / "rollouts.jsonl") == read_jsonl(full / "rollouts.jsonl")


def test_shared_final_is_a_plain_model_with_the_trained_head(tiny_model, tmp_path):
    """GPT-2 ties its head to the input embeddings; shared unties them, so final/ holds both."""
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    rallyrl.train(_cfg(tiny_model, run, {"reference": "shared", "num_layers_unfrozen": 1}))
    lm = AutoModelForCausalLM.from_pretrained(run / "final")
    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert lm.lm_head.weight is not lm.transformer.wte.weight
    assert torch.equal(lm.transformer.wte.weight, base.transformer.wte.weight)  # embeddings frozen
    assert not torch.equal(lm.lm_head.weight, base.lm_head.weight)  # head trained
    assert torch.equal(lm.transformer.h[0].attn.c_attn.weight, base.transformer.h[0].attn.c_attn.weight)


def test_lora_final_holds_the_adapter_and_a_merged_model(tiny_model, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = tmp_path / "run"
    rallyrl.train(_cfg(tiny_model, run, {"reference": "lora", "lora": {"r": 4, "merge_on_save": True}}))
    final = run / "final"
    assert (final / "adapter" / "adapter_config.json").is_file()
    assert (final / "adapter" / "adapter_model.safetensors").is_file()
    merged = AutoModelForCausalLM.from_pretrained(final).eval()
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), final / "adapter").eval()
    tok = AutoTokenizer.from_pretrained(final)
    ids = tok(["the cat sat on"], return_tensors="pt").input_ids
    with torch.no_grad():
        a, b = merged(ids).logits, adapted(ids).logits
        base = AutoModelForCausalLM.from_pretrained(tiny_model)(ids).logits
    assert torch.allclose(a, b, atol=1e-5)
    assert not torch.allclose(a, base, atol=1e-4)  # the adapter trained

    plain = tmp_path / "plain"
    rallyrl.train(_cfg(tiny_model, plain, {"reference": "lora"}, train={"iterations": 1}))
    assert (plain / "final" / "adapter_model.safetensors").is_file()
    assert not (plain / "final" / "model.safetensors").exists()


def test_shared_errors_name_the_problem(tiny_model, tmp_path):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    from rallyrl.models.reference import setup_shared

    with pytest.raises(ConfigError, match="model.num_layers_unfrozen must be > 0"):
        load_config({"model": {"path": str(tiny_model), "reference": "shared", "num_layers_unfrozen": 0}})
    cfg = load_config({"model": {"path": str(tiny_model), "reference": "shared", "num_layers_unfrozen": 3}})
    with pytest.raises(ConfigError, match=r"num_layers_unfrozen must be between 1 and the model's 2 layers, got 3"):
        load_models(cfg.model, seed=0)
    neox = GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1,
                                            num_attention_heads=2, intermediate_size=64))
    with pytest.raises(ConfigError, match=r"supports the architectures \['gpt2', 'llama'\].*'gpt_neox'"):
        setup_shared(neox, 1)
    with pytest.raises(ConfigError, match="model.lora.dropout must be 0"):
        load_config({"model": {"path": str(tiny_model), "reference": "lora", "lora": {"dropout": 0.1}}})
    with pytest.raises(ConfigError, match="unknown config key 'model.lora.rank'"):
        load_config({"model": {"path": str(tiny_model), "lora": {"rank": 4}}})
    bad = load_config({"model": {"path": str(tiny_model), "reference": "lora", "lora": {"target_modules": ["nope"]}}})
    with pytest.raises(ConfigError, match="model.lora.target_modules"):
        load_models(bad.model, seed=0)
