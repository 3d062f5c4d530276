"""The vLLM engine in-process on a tiny GPT-2 (runs in .venv-vllm; skipped where vLLM is not installed):
pushed weights change what it generates, the probe catches a skipped push, a hanging push times out,
token ids in / ids out with the HF engine's EOS meaning, one seed per request."""

from __future__ import annotations

import time

import pytest
import torch

from rallyrl.config import GenerationConfig, ModelConfig, VLLMConfig
from rallyrl.errors import EngineError
from rallyrl.models import load_models
from rallyrl.rollout import HFEngine, SamplingSpec

pytestmark = pytest.mark.vllm
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def setup(tiny_model):
    from rallyrl.rollout.vllm import VLLMEngine

    models = load_models(ModelConfig(path=str(tiny_model)), seed=0, value_head=False, reference=False)
    gen = GenerationConfig(max_new_tokens=8, vllm=VLLMConfig(kv_cache_gib=0.25, sync_timeout_s=60))
    engine = VLLMEngine.start(models.policy, models.tokenizer, str(tiny_model), gen, "float32",
                              "processed_logprobs", CPU)
    yield models, engine
    engine.close()


def _greedy(n=8):
    return SamplingSpec(max_new_tokens=n, do_sample=False, stop_token_ids=())


def _nudge(policy, scale):
    with torch.no_grad():
        for name, p in policy.lm.named_parameters():
            if "mlp.c_fc.weight" in name:
                p.add_(scale * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))


def test_start_pushes_the_policy_and_the_probe_agrees(setup):
    _, engine = setup
    assert engine.version == 0 and engine.last_probe["mean"] < 1e-4  # float32 both sides


def test_pushed_weights_change_what_is_generated_and_match_the_hf_engine(setup):
    models, engine = setup
    prompts = [[5, 6, 7], [40, 41]]
    hf = HFEngine(models.policy, models.tokenizer, CPU)
    before = engine.generate(prompts, _greedy()).token_ids
    assert before == hf.generate(prompts, _greedy()).token_ids  # the same weights, greedy: the same tokens
    _nudge(models.policy, 0.5)
    engine.sync(models.policy)
    after = engine.generate(prompts, _greedy())
    assert after.version == 1 and after.token_ids != before
    assert after.token_ids == hf.generate(prompts, _greedy()).token_ids


def test_the_probe_catches_a_skipped_push(setup, monkeypatch):
    models, engine = setup
    monkeypatch.setattr(type(engine), "_load", lambda self, policy: None)  # the push "succeeds" but applies nothing
    _nudge(models.policy, 0.5)
    with pytest.raises(EngineError, match=r"probe after the weight push of version \d+ disagrees.*differ by"):
        engine.sync(models.policy)
    monkeypatch.undo()
    engine.sync(models.policy)  # a real push brings it back in line
    assert engine.last_probe["mean"] < 1e-4


def test_a_hanging_push_times_out(setup, monkeypatch):
    models, engine = setup
    monkeypatch.setattr(type(engine), "_load", lambda self, policy: time.sleep(30))
    monkeypatch.setattr(engine.options, "sync_timeout_s", 0.5)
    t0 = time.perf_counter()
    with pytest.raises(EngineError, match="sync_timeout_s=0.5"):
        engine.sync(models.policy)
    assert time.perf_counter() - t0 < 20


def test_sampling_ids_logprobs_eos_and_seeds(setup):
    models, engine = setup
    eos = models.tokenizer.eos_token_id
    spec = SamplingSpec(max_new_tokens=8, temperature=1.0, stop_token_ids=(eos,), logprobs=True, seed=11)
    out = engine.generate([[5, 6, 7]] * 6, spec)
    assert len({tuple(t) for t in out.token_ids}) > 1  # one seed per request: a group's copies differ
    for ids in out.token_ids:  # cut after the first EOS, kept; never empty
        assert 1 <= len(ids) <= 8 and (eos not in ids[:-1])
    # the engine's sampling log-probs are the policy's (full vocabulary, temperature 1) for those very ids
    for i, ids in enumerate(out.token_ids):
        with torch.no_grad():
            logits = models.policy.lm(torch.tensor([[5, 6, 7] + ids])).logits[0, 2:-1]
        want = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(ids)[:, None])[:, 0]
        assert torch.allclose(out.logprobs[i, : len(ids)], want, atol=1e-4)
    # the request seeds are (spec.seed, version, call since the push, index): a new call, new seeds
    assert engine._seeds(11, 3) != engine._seeds(11, 3)


def test_a_batch_larger_than_one_scheduler_step_with_seeds(setup):
    """More prompt tokens than one engine step holds (max_num_batched_tokens): with chunked prefill a prompt
    split over two steps rewinds its seeded generator, which crashes on CPU ("CPU Generator does not use
    offset"); the engine prefills whole prompts per step instead, so a big batch runs."""
    models, engine = setup
    sched = engine.llm.llm_engine.vllm_config.scheduler_config
    assert not sched.enable_chunked_prefill
    length = min(48, engine.llm.llm_engine.model_config.max_model_len - 8)
    n = sched.max_num_batched_tokens // length + 3
    prompts = [[5 + (i + j) % 50 for j in range(length)] for i in range(n)]
    out = engine.generate(prompts, SamplingSpec(max_new_tokens=4, temperature=1.0, logprobs=True, seed=3))
    assert len(out.token_ids) == n and all(1 <= len(t) <= 4 for t in out.token_ids)
