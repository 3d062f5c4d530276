"""`rollout.logprobs_from: generate`: the policy's log-probs and values taken from the decoding itself
equal the separate forward pass's (up to float rounding) for every model kind, the sampled tokens are
the same, and a run with it resumes exactly."""

import pytest
import torch
from safetensors.torch import load_file

import rallyrl
from rallyrl.config import GenerationConfig, ModelConfig, load_config
from rallyrl.models import load_models
from rallyrl.rollout import score_tokens
from rallyrl.run.logs import read_jsonl
from tests.helpers.runs import base_config, killed_run_copy
from tests.helpers.sampling import generate

pytestmark = pytest.mark.smoke

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny_t5(tmp_path_factory):
    from rallyrl.testing import build_tiny_t5

    return build_tiny_t5(tmp_path_factory.mktemp("tiny") / "t5")


CASES = {  # id -> (model fixture, model.* settings)
    "gpt2": ("tiny_model", {}),
    "llama": ("tiny_llama", {}),  # RMSNorm, rotary positions, logits_to_keep in generate's prefill
    "shared-llama": ("tiny_llama", {"reference": "shared", "num_layers_unfrozen": 1}),
    "lora": ("tiny_model", {"reference": "lora", "lora": {"r": 4}}),
    "t5": ("tiny_t5", {"arch": "seq2seq"}),  # the decoder's state, not the (rescaled) LM-head input
}


@pytest.mark.parametrize("case", list(CASES))
def test_generation_scores_equal_the_forward_pass(case, request):
    fixture, model_cfg = CASES[case]
    torch.manual_seed(0)
    cfg = load_config({"model": {"path": str(request.getfixturevalue(fixture)), "value_head_std": 0.5, **model_cfg}})
    m = load_models(cfg.model, seed=0)
    tok = m.tokenizer
    # different prompt lengths (left padding), temperature, top-k, a stop sequence and EOS cuts
    q = [tok(p)["input_ids"] for p in ["the cat sat on the mat", "a", "good morning to", "birds"]] * 3
    gen = GenerationConfig(max_new_tokens=10, temperature=0.7, top_k=20, stop_sequences=["e"])
    torch.manual_seed(3)
    plain = generate(m.policy, tok, q, gen, True, CPU)
    torch.manual_seed(3)
    kept = generate(m.policy, tok, q, gen, True, CPU, scored=True)
    assert torch.equal(plain.response_ids, kept.response_ids) and plain.outputs == kept.outputs
    assert plain.response_mask.sum(1).min() < plain.response_mask.shape[1]  # some responses were cut short
    fwd = score_tokens(m.policy, m.reference, plain, gen.temperature, CPU)
    reused = score_tokens(m.policy, m.reference, kept, gen.temperature, CPU, from_generation=True)
    mask = plain.response_mask
    assert fwd.values[mask].abs().max() > 0.1  # a value head that is not zero, so the check means something
    torch.testing.assert_close(reused.logprobs, fwd.logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(reused.values, fwd.values, atol=1e-5, rtol=0)
    assert torch.equal(reused.logprobs[~mask], torch.zeros_like(reused.logprobs[~mask]))  # 0 on padding
    assert torch.equal(reused.ref_logprobs, fwd.ref_logprobs)  # the reference pass is unchanged


def test_greedy_generation_scores_use_the_sampling_temperature(tiny_model):
    m = load_models(ModelConfig(path=str(tiny_model), value_head_std=0.5), seed=0)
    tok = m.tokenizer
    q = [tok(p)["input_ids"] for p in ["the cat", "a dog ran"]]
    gen = GenerationConfig(max_new_tokens=5, temperature=1.7)
    plain = generate(m.policy, tok, q, gen, False, CPU)
    kept = generate(m.policy, tok, q, gen, False, CPU, scored=True)
    fwd = score_tokens(m.policy, m.reference, plain, gen.temperature, CPU)
    torch.testing.assert_close(kept.logprobs, fwd.logprobs, atol=1e-5, rtol=0)


def test_an_empty_chunk_and_a_missing_record(tiny_model):
    m = load_models(ModelConfig(path=str(tiny_model)), seed=0)
    g = generate(m.policy, m.tokenizer, [], GenerationConfig(), True, CPU, scored=True)
    assert len(g) == 0 and score_tokens(m.policy, m.reference, g, 1.0, CPU, from_generation=True) is None
    plain = generate(m.policy, m.tokenizer, [m.tokenizer("the")["input_ids"]], GenerationConfig(), True, CPU)
    with pytest.raises(ValueError, match="needs episodes sampled with"):
        score_tokens(m.policy, m.reference, plain, 1.0, CPU, from_generation=True)


def test_config_names_the_choices(tiny_model):
    with pytest.raises(Exception, match="rollout.logprobs_from"):
        load_config({"model": {"path": str(tiny_model)}, "rollout": {"logprobs_from": "cache"}})


def test_a_run_samples_the_same_and_resumes_exactly(tiny_model, tmp_path):
    kw = dict(train={"iterations": 3}, checkpoint={"interval": 1, "keep_last": 3})
    fwd = tmp_path / "forward"
    rallyrl.train(base_config(tiny_model, fwd, **kw))
    full = tmp_path / "full"
    rallyrl.train(base_config(tiny_model, full, rollout={"logprobs_from": "generate"}, **kw))
    a, b = read_jsonl(fwd / "metrics.jsonl"), read_jsonl(full / "metrics.jsonl")
    # iteration 1 samples from the same weights with the same streams: the same rollouts and rewards;
    # the per-sample KL is 0 against the forward pass and float rounding against the decoding's math
    # (so are the advantages, which come from the values)
    ra, rb = ([r for r in read_jsonl(d / "rollouts.jsonl") if r["step"] == 1] for d in (fwd, full))
    assert [r | {"kl": 0, "advantage": 0} for r in ra] == [r | {"kl": 0, "advantage": 0} for r in rb]
    assert max(abs(x["advantage"] - y["advantage"]) for x, y in zip(ra, rb)) < 1e-4
    assert all(r["kl"] == 0.0 for r in ra) and max(abs(r["kl"]) for r in rb) < 1e-4
    assert b[0]["reward/mean"] == a[0]["reward/mean"]
    assert a[0]["policy/kl"] == 0.0 and abs(b[0]["policy/kl"]) < 1e-4  # the KV-cached math, not exactly 0
    for k in ("policy/loss", "value/loss", "policy/clipfrac", "policy/approx_kl"):
        assert b[0][k] == pytest.approx(a[0][k], rel=1e-3, abs=1e-5), k
    # exact resume from step_1 on the new path
    resumed = killed_run_copy(full, tmp_path / "resumed", 1)
    kw["train"] = {"iterations": 3, "resume": "latest"}
    rallyrl.train(base_config(tiny_model, resumed, rollout={"logprobs_from": "generate"}, **kw))
    x = load_file(full / "checkpoints" / "step_3" / "policy.safetensors")
    y = load_file(resumed / "checkpoints" / "step_3" / "policy.safetensors")
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    assert read_jsonl(resumed / "rollouts.jsonl") == read_jsonl(full / "rollouts.jsonl")
