"""generation.prefill_once: a query repeated in a chunk (a group's G members) is prefilled once and its KV
cache (seq2seq: its encoding) expanded to the copies. Greedy decoding gives the same tokens as the
ordinary path, scored generation the same log-probs and values, sampling the same distribution (a
statistic over thousands of samples, not a seed match), and the cases it cannot serve take the ordinary
path."""

from __future__ import annotations

import pytest
import torch

from rallyrl.config import GenerationConfig, LoraConfig, ModelConfig
from rallyrl.models import load_models
from rallyrl.rollout import pad, prompt_index
from rallyrl.rollout.prefill import distinct_rows
from rallyrl.testing import build_tiny_t5
from tests.helpers.sampling import generate, sample

pytestmark = pytest.mark.smoke

PROMPTS = ["the cat sat on the mat", "good", "a dog ran in the park today"]
ORDER = (0, 0, 0, 1, 1, 2, 0, 2)  # repeats, not contiguous, of different lengths (left padding)


@pytest.fixture(scope="module")
def tiny_t5(tmp_path_factory):
    return build_tiny_t5(tmp_path_factory.mktemp("t5") / "t5")


def _models(path, **model):
    return load_models(ModelConfig(path=str(path), value_head_std=0.1, **model), seed=0)


def _batch(tok, order=ORDER):
    rows = [tok(PROMPTS[i]).input_ids for i in order]
    q, qm = pad(rows, tok.pad_token_id, left=True)
    return rows, q, qm


class _Calls:
    """The (rows, columns) of every call of the input embedding (seq2seq: the encoder's) while open:
    which batches ran."""

    def __init__(self, lm):
        self.emb = (lm.get_encoder() if lm.config.is_encoder_decoder else lm).get_input_embeddings()
        self.shapes = []

    def __enter__(self):
        self.h = self.emb.register_forward_hook(lambda _m, args, _o: self.shapes.append(tuple(args[0].shape)))
        return self.shapes

    def __exit__(self, *_):
        self.h.remove()


def test_prompt_index_and_distinct_rows():
    assert prompt_index([[1, 2], [3], [1, 2], [3], [4]]) == [0, 1, 0, 1, 4]
    assert prompt_index([[1, 2], [3], [4]]) is None  # no repeat: nothing to share
    firsts, expand = distinct_rows(torch.tensor([0, 1, 0, 1, 4]), torch.device("cpu"))
    assert firsts.tolist() == [0, 1, 4] and expand.tolist() == [0, 1, 0, 1, 2]
    assert distinct_rows(torch.tensor([0, 1, 2]), torch.device("cpu")) is None  # no repeat
    assert distinct_rows(None, torch.device("cpu")) is None


@pytest.mark.parametrize("kind", ["gpt2", "llama", "lora", "t5"])
def test_greedy_gives_the_same_tokens_log_probs_and_values(kind, tiny_model, tiny_llama, tiny_t5):
    path, model = {"gpt2": (tiny_model, {}), "llama": (tiny_llama, {}),
                   "lora": (tiny_model, {"reference": "lora", "lora": LoraConfig(r=4)}),
                   "t5": (tiny_t5, {"arch": "seq2seq"})}[kind]
    m = _models(path, **model)
    rows, q, qm = _batch(m.tokenizer)
    kw = dict(max_new_tokens=12, do_sample=False)  # greedy, no stop token: 12 tokens per row
    with _Calls(m.policy.lm) as plain_calls:
        plain = torch.tensor(sample(m.policy, m.tokenizer, rows, **kw).token_ids)
    with _Calls(m.policy.lm) as shared_calls:
        shared = torch.tensor(sample(m.policy, m.tokenizer, rows, prefill_once=True, **kw).token_ids)
    assert torch.equal(plain, shared) and plain.shape == (8, 12)
    # the ordinary path starts with all 8 rows; the shared one with the 3 distinct queries (a causal LM
    # prefills Q - 1 tokens and decodes the last query token with the 8 rows; T5 encodes all Q)
    Q = q.shape[1]
    assert plain_calls[0] == (8, Q)
    assert shared_calls[0] == ((3, Q) if kind == "t5" else (3, Q - 1))
    a = sample(m.policy, m.tokenizer, rows, logprobs=True, **kw)
    b = sample(m.policy, m.tokenizer, rows, prefill_once=True, logprobs=True, **kw)
    ids_a, lp_a, v_a = torch.tensor(a.token_ids), a.logprobs, a.values
    ids_b, lp_b, v_b = torch.tensor(b.token_ids), b.logprobs, b.values
    assert torch.equal(ids_a, ids_b) and torch.equal(ids_a, plain)
    assert torch.allclose(lp_a, lp_b, atol=1e-5) and torch.allclose(v_a, v_b, atol=1e-5)
    # and both agree with the scoring forward over the sampled tokens (the values are the ones the
    # value head gives on the states that chose each token)
    logits, values = m.policy(q, qm, ids_b, torch.ones_like(ids_b, dtype=torch.bool))
    lp = torch.log_softmax(logits.float(), -1).gather(-1, ids_b.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(lp, lp_b, atol=1e-4) and torch.allclose(values.float(), v_b, atol=1e-4)


# chi-square critical values at p = 0.001 (degrees of freedom -> value)
CHI2_999 = {7: 24.32}


def test_sampling_keeps_the_distribution(tiny_model):
    """3000 samples of one query, prefilled once vs 3000 times: the first token's counts fit the model's
    exact top-8 distribution (chi-square, p > 0.001) on both paths, and the mean log-probability of the
    sampled 3-token continuations (minus the entropy, a statistic of the whole sequence, so of every
    later step run on the expanded cache) agrees between the paths within 4 standard errors."""
    m = _models(tiny_model)
    tok, N, K = m.tokenizer, 3000, 8
    rows, q, qm = _batch(tok, order=(0,) * N)
    kw = dict(max_new_tokens=3, do_sample=True, temperature=1.0, top_k=K, top_p=1.0)  # no stop token
    with torch.no_grad():
        first = m.policy.lm(input_ids=q[:1], attention_mask=qm[:1]).logits[0, -1]  # (V,)
    top = first.topk(K)
    p_exact = torch.softmax(top.values, -1)  # (K,) top-k sampling renormalises over the k best
    stats = {}
    for name, once in (("plain", False), ("shared", True)):
        torch.manual_seed(123)
        ids = torch.tensor(sample(m.policy, tok, rows, prefill_once=once, **kw).token_ids)  # (N, 3)
        counts = torch.stack([(ids[:, 0] == t).sum() for t in top.indices]).double()
        assert counts.sum() == N  # every first token is one of the top 8
        chi2 = ((counts - N * p_exact.double()) ** 2 / (N * p_exact.double())).sum().item()
        assert chi2 < CHI2_999[K - 1], (name, chi2, counts.tolist())
        with torch.no_grad():  # the exact log-probability of each sampled continuation, by one forward
            logits, _ = m.policy(q, qm, ids, torch.ones_like(ids, dtype=torch.bool))
        lp = torch.log_softmax(logits.double(), -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1).sum(1)  # (N,)
        stats[name] = (lp.mean().item(), lp.std().item() / N**0.5)
    (a, se_a), (b, se_b) = stats["plain"], stats["shared"]
    assert abs(a - b) < 4 * (se_a**2 + se_b**2) ** 0.5, stats


def test_the_rollout_step_prefills_once_by_config_and_falls_back_when_it_cannot(tiny_model):
    m = _models(tiny_model)
    tok = m.tokenizer
    rows, _, _ = _batch(tok)
    out, calls = {}, {}
    for on in (True, False):
        gen = GenerationConfig(max_new_tokens=8, prefill_once=on)
        with _Calls(m.policy.lm) as shapes:
            out[on] = generate(m.policy, tok, rows, gen, do_sample=False, device=torch.device("cpu"), scored=True)
        calls[on] = shapes[0][0]
    assert (calls[True], calls[False]) == (3, 8)
    assert out[True].response_lists == out[False].response_lists and out[True].outputs == out[False].outputs
    assert torch.allclose(out[True].logprobs, out[False].logprobs, atol=1e-5)
    # no repeated query, or one-token queries: the ordinary path (one batch of all rows from the start)
    one_token = [[5], [5], [7], [5]]
    for batch in ([tok(p).input_ids for p in PROMPTS], one_token):
        with _Calls(m.policy.lm) as shapes:
            g = generate(m.policy, tok, batch, GenerationConfig(max_new_tokens=4), do_sample=False,
                         device=torch.device("cpu"))
        assert shapes[0][0] == len(batch) and len(g) == len(batch)
