"""model.arch: seq2seq (tiny T5): rollout log-probs equal generate()'s, EOS truncation at </s>."""

import pytest
import torch

from rallyrl.config import GenerationConfig, ModelConfig
from rallyrl.models import load_models
from rallyrl.rollout import Episodes, pad, score_tokens
from tests.helpers.sampling import generate

pytestmark = pytest.mark.smoke


@pytest.fixture(scope="module")
def t5(tmp_path_factory):
    from rallyrl.testing import build_tiny_t5

    path = build_tiny_t5(tmp_path_factory.mktemp("tiny") / "t5")
    return load_models(ModelConfig(path=str(path), arch="seq2seq"), seed=0)


def test_seq2seq_logprobs_match_generate_scores_with_left_padding(t5):
    tok, lm = t5.tokenizer, t5.policy.lm
    q = [tok(p)["input_ids"] for p in ["the cat sat on the mat", "a", "good morning to"]]
    ids, mask = pad(q, tok.pad_token_id, left=True)
    torch.manual_seed(1)
    out = lm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=True, top_k=None,
                      temperature=0.7, pad_token_id=tok.pad_token_id, eos_token_id=-1, output_scores=True,
                      return_dict_in_generate=True)
    resp = out.sequences[:, 1:]  # (B, T): drop the decoder-start token
    gen_lp = torch.stack([torch.log_softmax(s, -1) for s in out.scores], 1).gather(-1, resp.unsqueeze(-1))[..., 0]
    ri, rm = pad([r.tolist() for r in resp], tok.pad_token_id, left=False)
    g = Episodes(ids, mask, ri, rm, rm, [r.tolist() for r in resp], [""] * 3)
    scored = score_tokens(t5.policy, t5.reference, g, 0.7, torch.device("cpu"))
    assert torch.allclose(scored.logprobs, gen_lp, atol=1e-4)
    assert torch.equal(scored.logprobs, scored.ref_logprobs)  # first-iteration KL exactly 0
    # left padding of the encoder is exact: a query alone gives the same log-probs as padded in a batch
    alone = score_tokens(t5.policy, t5.reference, Episodes(ids[1:2, -len(q[1]):], mask[1:2, -len(q[1]):],
                         ri[1:2], rm[1:2], rm[1:2], [], [""]), 0.7, torch.device("cpu"))
    assert torch.allclose(alone.logprobs[0], scored.logprobs[1], atol=1e-5)


def test_seq2seq_generate_truncates_at_eos(t5):
    tok = t5.tokenizer
    torch.manual_seed(0)
    g = generate(t5.policy, tok, [tok("the")["input_ids"]] * 16, GenerationConfig(max_new_tokens=12, do_sample=True),
                 True, torch.device("cpu"))
    for r, o in zip(g.response_lists, g.outputs):
        assert 1 <= len(r) <= 12 and tok.pad_token_id not in r[:1]  # decoder-start token stripped
        if tok.eos_token_id in r:
            assert r.index(tok.eos_token_id) == len(r) - 1
        assert o == tok.decode(r, skip_special_tokens=True)


@pytest.mark.parametrize("reference", ["shared", "lora"])
def test_seq2seq_refuses_causal_only_references_before_loading(reference, tmp_path):
    from rallyrl.config import ConfigError, load_config

    msg = rf"model.reference='{reference}' is implemented for model.arch=causal only"
    with pytest.raises(ConfigError, match=msg):  # at config time: `rallyrl check` and the preflight see it
        load_config({"model": {"path": "m", "arch": "seq2seq", "reference": reference}})
    with pytest.raises(ConfigError, match=msg):  # a ModelConfig built in code: refused before any folder is read
        load_models(ModelConfig(path=str(tmp_path / "missing"), arch="seq2seq", reference=reference), seed=0)
