"""The generation-engine seam (rallyrl/rollout/engine.py): any object with ``ready`` / ``generate`` /
``sync`` / ``version`` drives the rollout stage; what it sampled is exactly what is trained (token in,
token out); the two masks stay apart; the HF engine counts its weight versions."""

from __future__ import annotations

import contextlib

import pytest
import torch

from rallyrl.config import GenerationConfig
from rallyrl.inputs import PromptSet
from rallyrl.models import load_models
from rallyrl.config import ModelConfig
from rallyrl.reward.step import NamedRewardFn, RewardStep
from rallyrl.rollout import (HFEngine, Rollouts, Sampled, SamplingSpec, Shard, collect_rollouts, run_episodes,
                             truncate_at_stop)
from rallyrl.rollout.hf import truncate

CPU = torch.device("cpu")


class ScriptedEngine:
    """A second engine behind the protocol: it answers every prompt with a fixed script of ids (as a
    remote engine would hand back its samples) and records what it was asked."""

    def __init__(self, answers: dict[tuple[int, ...], list[int]]) -> None:
        self.answers, self.version, self.calls, self.entered = answers, 7, [], 0

    @contextlib.contextmanager
    def ready(self):
        self.entered += 1
        yield

    def generate(self, prompts, spec):
        self.calls.append((prompts, spec))
        return Sampled([list(self.answers[tuple(p)]) for p in prompts], version=self.version)

    def sync(self, policy):
        self.version += 1


@pytest.fixture(scope="module")
def models(tiny_model):
    return load_models(ModelConfig(path=str(tiny_model)), seed=0)


def test_the_rollout_stage_trains_exactly_what_an_engine_sampled(models):
    tok = models.tokenizer
    texts = ["the cat", "a dog", "good morning"]
    ids = [tok(t)["input_ids"] for t in texts]
    answers = {tuple(ids[0]): [5, 6, 7], tuple(ids[1]): [8], tuple(ids[2]): [9, 10]}
    engine = ScriptedEngine(answers)
    prompts = PromptSet([{"prompt": t} for t in texts], ids)
    step = RewardStep([NamedRewardFn("len", lambda s, p, o, **k: [float(len(x)) for x in k["output_token_ids"]])])
    spec = SamplingSpec.of(GenerationConfig(max_new_tokens=4), True, tok)
    ro, _, _ = collect_rollouts(models, engine, step, prompts, Shard([0, 1, 2], 0, 2, 2), spec, CPU)
    assert engine.entered == 2 and [len(c[0]) for c in engine.calls] == [2, 1]  # every round enters ready()
    assert engine.calls[0][1] is spec  # the spec is passed through unchanged
    assert [r[:n] for r, n in zip(ro.response_ids.tolist(), ro.response_mask.sum(1).tolist())] == \
        [[5, 6, 7], [8], [9, 10]]
    assert torch.equal(ro.action_mask, ro.response_mask)  # a single turn: every response token is an action
    assert ro.outputs == [tok.decode(a, skip_special_tokens=True) for a in ([5, 6, 7], [8], [9, 10])]
    assert ro.scores.tolist() == [3.0, 1.0, 2.0]  # the reward saw the very ids
    # the scoring pass ran the policy over those ids: log-probs are real (non-zero) on actions only
    assert (ro.logprobs[ro.action_mask] < 0).all() and (ro.logprobs[~ro.action_mask] == 0).all()


def test_episodes_carry_the_engine_version_and_an_empty_round(models):
    tok = models.tokenizer
    engine = ScriptedEngine({(1, 2): [3]})
    spec = SamplingSpec(max_new_tokens=2, logprobs=True)
    ep = run_episodes(engine, tok, [[1, 2]], spec)
    assert ep.version == 7 and ep.response_lists == [[3]]
    empty = run_episodes(engine, tok, [], spec)
    assert len(empty) == 0 and empty.version == 7 and engine.entered == 2  # entered with no prompt too
    engine.sync(None)
    assert run_episodes(engine, tok, [[1, 2]], spec).version == 8


def test_hf_engine_counts_syncs_and_samples_with_the_policy(models):
    tok = models.tokenizer
    engine = HFEngine(models.policy, tok, CPU, version=3)
    spec = SamplingSpec(max_new_tokens=4, do_sample=False, logprobs=True, temperature=1.0)
    with engine.ready():
        out = engine.generate([tok("the cat")["input_ids"]], spec)
    assert out.version == 3 and len(out.token_ids[0]) == 4 and out.logprobs.shape == (1, 4)
    engine.sync(models.policy)
    assert engine.version == 4
    # the sampling log-probs are the policy's: the forward over the same ids agrees
    q = torch.tensor([tok("the cat")["input_ids"]])
    r = torch.tensor(out.token_ids)
    logits, _ = models.policy(q, torch.ones_like(q, dtype=torch.bool), r, torch.ones_like(r, dtype=torch.bool))
    lp = torch.log_softmax(logits.float(), -1).gather(-1, r.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(out.logprobs, lp, atol=1e-5, rtol=0)


def test_sampling_spec_of_the_generation_config(models):
    tok = models.tokenizer
    gen = GenerationConfig(max_new_tokens=9, temperature=0.5, top_k=3, top_p=0.9, stop_sequences=["."])
    spec = SamplingSpec.of(gen, False, tok, logprobs=True)
    assert (spec.max_new_tokens, spec.do_sample, spec.temperature, spec.top_k, spec.top_p) == (9, False, 0.5, 3, 0.9)
    assert spec.stop_token_ids == (tok.eos_token_id,) and spec.stop_sequences == (".",) and spec.logprobs


def test_truncation_keeps_the_stop_token_and_cuts_at_a_stop_sequence(models):
    tok = models.tokenizer
    spec = SamplingSpec(max_new_tokens=8, stop_token_ids=(99,))
    assert truncate([1, 2, 99, 4, 99], spec, tok) == [1, 2, 99]  # the stop token is an action: kept
    assert truncate([1, 2, 3], spec, tok) == [1, 2, 3]
    text = tok("the cat sat. on the mat")["input_ids"]
    cut = truncate(text, SamplingSpec(max_new_tokens=8, stop_sequences=(".",)), tok)
    assert cut == truncate_at_stop(text, tok, ["."]) and tok.decode(cut).endswith(".")


def test_rollouts_concat_keeps_a_holed_action_mask():
    def part(am):
        am = torch.tensor([am])
        rm = torch.ones_like(am)
        z = torch.zeros(am.shape)
        return Rollouts(torch.tensor([[1]]), torch.tensor([[True]]), torch.ones_like(am, dtype=torch.long), rm, am,
                        z, None, None, torch.tensor([0.0]), None, ["p"], ["o"], [{}], [0], [0], [{}])

    ro = Rollouts.concat([part([True, False, True]), part([False, True])], pad_id=0)
    assert ro.action_mask.tolist() == [[True, False, True], [False, True, False]]
    assert ro.response_mask.tolist() == [[True, True, True], [True, True, False]]
