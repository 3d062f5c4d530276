"""The log-prob pass sees exactly what generate() saw: same tokens, padding, positions and temperature."""

import pytest
import torch

from rallyrl import ops
from rallyrl.config import GenerationConfig, ModelConfig
from rallyrl.models import load_models
from rallyrl.rollout import Episodes, pad, score_tokens, truncate_at_stop
from tests.helpers.sampling import generate

pytestmark = pytest.mark.smoke


def _gen(q, r, pad_id):
    """Episodes for given query/response token lists (as generate() would pad them)."""
    qi, qm = pad(q, pad_id, left=True)
    ri, rm = pad(r, pad_id, left=False)
    return Episodes(qi, qm, ri, rm, rm, r, ["" for _ in r])


@pytest.fixture(scope="module")
def models(tiny_model):
    torch.manual_seed(0)
    return load_models(ModelConfig(path=str(tiny_model)), seed=0)


def test_logprobs_match_generate_scores_with_left_padding(models):
    tok, lm = models.tokenizer, models.policy.lm
    prompts = ["the cat sat on the mat", "a", "good morning to"]  # different lengths -> left padding
    q = [tok(p)["input_ids"] for p in prompts]
    ids, mask = pad(q, tok.pad_token_id, left=True)
    temperature = 0.7
    torch.manual_seed(1)
    out = lm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=True, top_k=None,
                      temperature=temperature, pad_token_id=tok.pad_token_id, output_scores=True,
                      return_dict_in_generate=True)
    resp = out.sequences[:, ids.shape[1]:]  # (B, T)
    # generate's processed scores are the temperature-scaled logits it sampled from
    gen_lp = torch.stack([torch.log_softmax(s, -1) for s in out.scores], 1)  # (B, T, V)
    gen_lp = gen_lp.gather(-1, resp.unsqueeze(-1)).squeeze(-1)  # (B, T)
    r = [row.tolist() for row in resp]
    g = _gen(q, r, tok.pad_token_id)
    scored = score_tokens(models.policy, models.reference, g, temperature, torch.device("cpu"))
    m = g.response_mask
    assert torch.allclose(scored.logprobs[m], gen_lp[m], atol=1e-4)
    # the reference is a frozen copy of the same weights: identical log-probs before training
    assert torch.equal(scored.logprobs, scored.ref_logprobs)


def test_generate_truncates_at_eos_and_keeps_it(models):
    tok = models.tokenizer
    gen = GenerationConfig(max_new_tokens=12, do_sample=True)
    torch.manual_seed(0)
    g = generate(models.policy, tok, [tok("the")["input_ids"]] * 16, gen, True, torch.device("cpu"))
    assert g.response_mask.sum(1).tolist() == [len(r) for r in g.response_lists]  # padded once, consistently
    for r, o in zip(g.response_lists, g.outputs):
        assert 1 <= len(r) <= 12
        if tok.eos_token_id in r:
            assert r.index(tok.eos_token_id) == len(r) - 1  # nothing after EOS is trained on
        assert o == tok.decode(r, skip_special_tokens=True)  # the reward sees exactly the trained tokens


def test_stop_sequence_truncation_is_the_shortest_prefix(models):
    tok = models.tokenizer
    ids = tok("the cat sat. on the mat. a dog")["input_ids"]
    cut = truncate_at_stop(ids, tok, ["."])
    text = tok.decode(cut)
    assert text.endswith(".") and text.count(".") == 1 and text.startswith("the cat sat")
    assert truncate_at_stop(ids, tok, ["zzz"]) == ids
    assert "." not in tok.decode(cut[:-1])


def test_training_forward_matches_rollout_pass_after_column_trimming(models):
    """ppo_update trims all-padding columns per minibatch; the log-probs must not change."""
    tok = models.tokenizer
    q = [tok(p)["input_ids"] for p in ["the cat sat on the mat", "a dog"]]
    r = [tok(" ran home")["input_ids"], tok(" sat")["input_ids"]]
    cpu = torch.device("cpu")
    full_g = _gen(q, r, tok.pad_token_id)
    full = score_tokens(models.policy, models.reference, full_g, 1.0, cpu)
    # second sample alone: its query needs no left padding, its response no right padding
    alone = score_tokens(models.policy, models.reference, _gen(q[1:], r[1:], tok.pad_token_id), 1.0, cpu)
    n = len(r[1])
    assert torch.allclose(full.logprobs[1, :n], alone.logprobs[0, :n], atol=1e-5)
    assert torch.allclose(full.values[1, :n], alone.values[0, :n], atol=1e-5)
    lp = ops.masked_sum(full.logprobs, full_g.response_mask)
    assert torch.isfinite(lp)


@pytest.mark.parametrize("head", ["linear", "mlp"])
def test_value_head_init_is_shared_and_starts_at_zero(tiny_model, head):
    from rallyrl.models import CausalPolicy
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(tiny_model)
    torch.manual_seed(123)  # the global RNG must not matter: init comes from the shared seed
    a = CausalPolicy(lm, value_head_std=0.02, seed=5, head=head)
    torch.manual_seed(456)
    b = CausalPolicy(lm, value_head_std=0.02, seed=5, head=head)
    for (ka, va), (kb, vb) in zip(a.v_head.state_dict().items(), b.v_head.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)
    zero = CausalPolicy(lm, value_head_std=0.0, seed=5, head=head)
    q, r = torch.tensor([[5, 6]]), torch.tensor([[7, 8]])
    _, values = zero(q, torch.ones_like(q, dtype=torch.bool), r, torch.ones_like(r, dtype=torch.bool))
    assert values.shape == (1, 2) and torch.equal(values, torch.zeros(1, 2))
