"""model.prefill_once: in the forward passes over rollouts (scoring, reference, training) a query repeated
in a batch runs once, its KV cache (seq2seq: its encoding) expanded to the copies by index. The same
logits, values, log-probs and gradients as the full forward within fp32 rounding, on GPT-2, Llama,
LoRA, activation checkpointing and T5; the distinct rows really are what the prompt pass runs; the cases
it cannot serve run the full forward; and a whole run trains as with it off."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import rallyrl
from rallyrl.config import LoraConfig, ModelConfig
from rallyrl.models import causal, load_models
from rallyrl.models.prefix import causal_prefix_supported, distinct_queries
from rallyrl.rollout import pad
from rallyrl.testing import build_tiny_t5
from rallyrl.tracking import read_jsonl
from tests.helpers.runs import base_config

pytestmark = pytest.mark.smoke

PROMPTS = ["the cat sat on the mat", "good", "a dog ran in the park today"]
ORDER = (0, 2, 0, 1, 1, 2, 0, 0)  # repeats, not contiguous, of different lengths (left padding)
RESP_LEN = (5, 2, 7, 1, 6, 7, 3, 4)  # right padding of different widths; one 1-token response


@pytest.fixture(scope="module")
def tiny_t5(tmp_path_factory):
    return build_tiny_t5(tmp_path_factory.mktemp("t5") / "t5")


def test_distinct_queries_by_hand():
    # pad id 0; row 3 has a REAL token 0 where rows 0, 1 and 4 have a pad: a different query
    q = torch.tensor([[0, 5, 6], [0, 5, 6], [7, 8, 9], [0, 5, 6], [0, 5, 6]])
    qm = torch.tensor([[0, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1], [0, 1, 1]], dtype=torch.bool)
    firsts, expand = distinct_queries(q, qm)
    # sorted keys: [-1, 5, 6] (rows 0, 1, 4), [0, 5, 6] (row 3), [7, 8, 9] (row 2)
    assert firsts.tolist() == [0, 3, 2] and expand.tolist() == [0, 0, 2, 1, 0]
    assert distinct_queries(q[1:4], qm[1:4]) is None  # no repeat: nothing to share


def _batch(tok, device="cpu"):
    q, qm = pad([tok(PROMPTS[i]).input_ids for i in ORDER], tok.pad_token_id, left=True)  # (8, Q)
    g = torch.Generator().manual_seed(4)
    r = torch.randint(3, len(tok), (len(ORDER), max(RESP_LEN)), generator=g)
    rm = torch.arange(r.shape[1]) < torch.tensor(RESP_LEN).unsqueeze(1)  # (8, T)
    return q, qm, r.masked_fill(~rm, tok.pad_token_id), rm


def _outputs(policy, q, qm, r, rm):
    """Masked logits and values of the policy's forward, and the gradient of a loss that reads both."""
    policy.zero_grad(set_to_none=True)
    logits, values = policy(q, qm, r, rm)
    m = rm.unsqueeze(-1)
    loss = (logits.float().log_softmax(-1).gather(-1, r.unsqueeze(-1)) * m).sum()
    if values is not None:
        loss = loss + (values * rm).square().sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
    return (logits * m).detach(), None if values is None else (values * rm).detach(), grads


class _FirstBlockRows:
    """The batch sizes the policy's first transformer block (seq2seq: the encoder's) runs on while open."""

    def __init__(self, lm):
        from rallyrl.models.base import transformer_blocks

        root = lm.get_encoder() if lm.config.is_encoder_decoder else lm
        self.block, self.rows = transformer_blocks(root)[0], []

    def __enter__(self):
        self.h = self.block.register_forward_pre_hook(lambda _m, args: self.rows.append(args[0].shape[0]))
        return self.rows

    def __exit__(self, *_):
        self.h.remove()


CASES = {
    "gpt2": ("tiny_model", {}),
    "llama": ("tiny_llama", {}),  # rotary positions, grouped-query attention, untied head
    "gpt2-lora": ("tiny_model", {"reference": "lora", "lora": LoraConfig(r=4)}),
    "llama-lora-ckpt": ("tiny_llama", {"reference": "lora", "lora": LoraConfig(r=4), "gradient_checkpointing": True}),
    "gpt2-ckpt": ("tiny_model", {"gradient_checkpointing": True}),
    "llama-shared": ("tiny_llama", {"reference": "shared", "num_layers_unfrozen": 1}),
    "t5": ("tiny_t5", {"arch": "seq2seq"}),
    "t5-ckpt": ("tiny_t5", {"arch": "seq2seq", "gradient_checkpointing": True}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_same_logits_values_logprobs_and_gradients(case, request):
    fixture, model = CASES[case]
    path = request.getfixturevalue(fixture)
    out = {}
    for on in (False, True):
        torch.manual_seed(0)
        m = load_models(ModelConfig(path=str(path), value_head_std=0.1, prefill_once=on, **model), seed=0)
        q, qm, r, rm = _batch(m.tokenizer)
        with _FirstBlockRows(m.policy.lm) as rows:
            logits, values, grads = _outputs(m.policy, q, qm, r, rm)
        with torch.no_grad():
            ref = m.reference.logprobs(q, qm, r, rm, 0.7) * rm
        out[on] = logits, values, grads, ref, rows
    (l0, v0, g0, r0, rows_off), (l1, v1, g1, r1, rows_on) = out[False], out[True]
    # the prompt pass ran on the 3 distinct queries, the response pass on all 8 rows (a recomputation under
    # checkpointing runs each again); seq2seq: the encoder ran on the 3 only. Off: every pass on all 8
    seq2seq = model.get("arch") == "seq2seq"
    assert set(rows_off) == {8} and set(rows_on) == ({3} if seq2seq else {3, 8}), (rows_off, rows_on)
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v1, v0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(r1, r0, rtol=1e-5, atol=1e-5)
    assert g1.keys() == g0.keys() and g0
    for k in g0:  # relative to the largest entry of each gradient: fp32 rounding of sums over 8 rows
        scale = g0[k].abs().max().clamp(min=1e-6)
        assert ((g1[k] - g0[k]).abs().max() / scale) < 1e-4, (k, (g1[k] - g0[k]).abs().max(), scale)


def test_the_full_forward_where_nothing_is_shared(tiny_model):
    m = load_models(ModelConfig(path=str(tiny_model), value_head_std=0.1), seed=0)
    tok = m.tokenizer
    q, qm, r, rm = _batch(tok)
    cases = {
        "no repeated query": (q[[0, 1, 3]], qm[[0, 1, 3]], r[[0, 1, 3]], rm[[0, 1, 3]]),
        "one-token queries": (q[:, -1:], qm[:, -1:], r, rm),  # nothing to cache before the last token
    }
    for what, (qq, qqm, rr, rrm) in cases.items():
        with _FirstBlockRows(m.policy.lm) as rows:
            m.policy(qq, qqm, rr, rrm)
        assert rows == [len(qq)], what
    off = load_models(ModelConfig(path=str(tiny_model), prefill_once=False), seed=0)
    assert not off.policy.prefill_once and not off.reference.prefill_once
    with _FirstBlockRows(off.policy.lm) as rows:
        off.policy(q, qm, r, rm)
    assert rows == [8]


def test_fixed_passes_run_the_prompt_pass_on_every_batch(tiny_llama):
    """model.sharding: fsdp builds the policy with ``fixed_passes``: a batch without a repeated query
    (D = B) and one of one-token queries (behind a masked pad column) still take both passes, with the
    full forward's results."""
    torch.manual_seed(0)
    full = load_models(ModelConfig(path=str(tiny_llama), value_head_std=0.1, prefill_once=False), seed=0).policy
    torch.manual_seed(0)
    m = load_models(ModelConfig(path=str(tiny_llama), value_head_std=0.1, sharding="fsdp"), seed=0)
    assert m.policy.fixed_passes and not full.fixed_passes
    q, qm, r, rm = _batch(m.tokenizer)
    for what, rows in (("no repeat", [0, 1, 3]), ("one-token queries", [0, 1, 2, 3])):  # the latter: 2 repeat
        qq, qqm = (q[rows], qm[rows]) if what == "no repeat" else (q[rows, -1:], qm[rows, -1:])
        args = (qq, qqm, r[rows], rm[rows])
        with _FirstBlockRows(m.policy.lm) as seen:
            logits, values, grads = _outputs(m.policy, *args)
        distinct = len({tuple(x) for x in qq.masked_fill(~qqm, -1).tolist()})
        assert seen == [distinct, len(rows)], what  # the prompt pass, then the response pass
        l0, v0, g0 = _outputs(full, *args)
        torch.testing.assert_close(logits, l0, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(values, v0, rtol=1e-5, atol=1e-5)
        for k in g0:
            assert ((grads[k] - g0[k]).abs().max() / g0[k].abs().max().clamp(min=1e-6)) < 1e-4, (what, k)


def test_models_whose_cache_is_not_plain_attention_run_the_full_forward(tiny_llama):
    from transformers import AutoModelForCausalLM, MistralConfig, MistralForCausalLM

    assert causal_prefix_supported(AutoModelForCausalLM.from_pretrained(tiny_llama))
    torch.manual_seed(0)
    sliding = MistralForCausalLM(MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                               num_attention_heads=2, num_key_value_heads=1, sliding_window=4))
    assert not causal_prefix_supported(sliding)  # a sliding-window cache: its layer drops old keys
    policy = causal.CausalPolicy(sliding.eval(), 0.0, 0, head=None, prefill_once=True)
    assert not policy.prefill_once


AGREE = {  # the reference's passes match the policy's scoring pass, so the two give the same bits at the start
    "llama-shared": ("tiny_llama", {"reference": "shared", "num_layers_unfrozen": 1}),  # policy scores full
    "gpt2-copy-fsdp": ("tiny_model", {"sharding": "fsdp"}),  # fixed passes on both (not sharded here)
    "llama-lora-fsdp": ("tiny_llama", {"reference": "lora", "lora": LoraConfig(r=4), "sharding": "fsdp"}),
    "gpt2-copy": ("tiny_model", {}),
}


@pytest.mark.parametrize("case", list(AGREE))
def test_policy_and_reference_agree_bit_for_bit_before_the_first_update(case, request):
    """policy/kl is exactly 0 before the first update (docs/models.md): with the option on, the scoring
    pass's policy log-probs equal the reference's bit for bit, with repeated queries and without."""
    fixture, model = AGREE[case]
    m = load_models(ModelConfig(path=str(request.getfixturevalue(fixture)), prefill_once=True, **model), seed=0)
    q, qm, r, rm = _batch(m.tokenizer)
    for rows in (list(range(8)), [0, 3, 1]):  # repeats; no repeat (fixed passes: two passes anyway)
        with torch.no_grad():
            logits, _ = m.policy(q[rows], qm[rows], r[rows], rm[rows])
            policy = rallyrl.ops.logprobs_from_logits(logits.float() / 0.7, r[rows])
            ref = m.reference.logprobs(q[rows], qm[rows], r[rows], rm[rows], 0.7)
        assert torch.equal(policy * rm[rows], ref * rm[rows]), (case, rows, (policy - ref)[rm[rows]].abs().max())


def test_a_run_trains_as_with_it_off(tiny_model, tmp_path, monkeypatch):
    """GRPO (G 4) with the KL in the loss (a copy reference), micro-batches of 4: every forward over
    rollouts shares (counted), and the metrics and final weights equal the run with it off within
    float tolerance."""
    calls = {"n": 0}
    shared = causal.shared_causal_forward

    def counting(*args, **kwargs):
        calls["n"] += 1
        return shared(*args, **kwargs)

    monkeypatch.setattr(causal, "shared_causal_forward", counting)
    metrics, n = {}, {}
    for on in (True, False):
        calls["n"] = 0
        cfg = base_config(tiny_model, tmp_path / str(on),
                          rollout={"num_rollouts": 8, "samples_per_prompt": 4, "chunk_size": 4},
                          ppo={"estimator": "grpo", "kl_in": "loss", "kl_estimator": "k3", "init_kl_coef": 0.1, "micro_batch_size": 4,
                               "num_minibatches": 1})
        cfg["model"]["prefill_once"] = on
        rallyrl.train(cfg)
        n[on] = calls["n"]
        metrics[on] = read_jsonl(tmp_path / str(on) / "metrics.jsonl")
    # per iteration: 2 chunks (each one whole group) x (policy + reference) scoring passes, and 2 epochs x
    # 2 micro-batches of 4 rows out of 2 groups (so a repeated query in each)
    assert n[True] == 2 * (2 * 2 + 2 * 2) and n[False] == 0, n
    assert len(metrics[True]) == len(metrics[False]) == 2
    for a, b in zip(metrics[True], metrics[False]):
        assert a.keys() == b.keys()
        for k in a:
            if not k.startswith(("time/", "memory/")):
                assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), (k, a[k], b[k])
    wa, wb = (load_file(tmp_path / str(on) / "final" / "model.safetensors") for on in (True, False))
    assert wa.keys() == wb.keys()
    for k in wa:  # 4 AdamW steps at lr 1e-3 (each moves a weight by up to ~1e-3): measured <= 4e-6 apart
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=2e-5)
