"""TRL-signature reward functions: recognised from their parameters (or by ``reward.signature``), called
as TRL's GRPOTrainer calls them, and refused at start, with the function, the parameter or column and
the fix named, when no call could work (ambiguous or impossible signatures, data columns that collide
with an argument rallyrl passes)."""

from __future__ import annotations

import functools

import pytest

from rallyrl.config import ConfigError, load_config
from rallyrl.reward import NamedRewardFn, RewardStep, Samples
from rallyrl.reward.loading import resolve_reward_fns
from rallyrl.reward.scoring import score_samples
from rallyrl.reward.signature import (RewardSignatureError, call_arguments, check_columns, detect_signature,
                                      passed_names)


# Functions with the signatures TRL's library and docs use (bodies are ours).
def think_format_reward(completions, **kwargs):  # trl.rewards.think_format_reward
    return [1.0 if c[0]["content"].startswith("<think>") else 0.0 for c in completions]


def accuracy_reward(completions, solution, log_extra=None, **kwargs):  # trl.rewards.accuracy_reward
    return [None if s is None else float(c[0]["content"].strip() == s) for c, s in zip(completions, solution)]


class SoftOverlong:  # trl.rewards.get_soft_overlong_punishment(...) returns a callable object like this
    def __call__(self, completion_ids, **kwargs):
        return [-1.0 if len(ids) > 3 else 0.0 for ids in completion_ids]


def answer_reward(completions, answer, **kwargs):  # the issue's example: a data column by name
    return [float(str(a) in (c if isinstance(c, str) else c[0]["content"])) for c, a in zip(completions, answer)]


async def async_reward(prompts, completions, **kwargs):  # TRL also takes `async def` functions
    return [float(len(c)) for c in completions]


def trlx_fn(samples, prompts, outputs, **kwargs):
    return [0.0] * len(samples)


def ambiguous(samples, completions, **kwargs):  # names from both signatures
    return [0.0] * len(samples)


def keywords_only(**kwargs):
    return [float(len(c)) for c in kwargs["completions"]]


@pytest.mark.parametrize("fn, expected", [
    (trlx_fn, "trlx"),
    (lambda s, p, o, **k: [0.0] * len(s), "trlx"),
    (lambda *a, **k: [0.0] * len(a[0]), "trlx"),
    (functools.partial(trlx_fn), "trlx"),
    (think_format_reward, "trl"),
    (accuracy_reward, "trl"),
    (SoftOverlong(), "trl"),
    (answer_reward, "trl"),
    (async_reward, "trl"),
    (keywords_only, "trl"),  # only callable by keyword
])
def test_auto_detection(fn, expected):
    assert detect_signature(fn, "f") == expected


def test_remote_reward_is_a_trlx_function():
    from rallyrl.reward import RemoteReward

    assert detect_signature(RemoteReward("http://127.0.0.1:9"), "remote") == "trlx"


@pytest.mark.parametrize("fn, message", [
    (lambda samples, completions, **kw: [], r"reward function 'f' has parameters of both signatures: samples "
                                            r"\(trlx.*completions \(TRL.*set reward.signature: trl or trlx"),
    (lambda prompts, **kw: [], r"reward function 'f': its first parameter is 'prompts', which TRL fills with the "
                               r"prompts but trlx.*with the samples.*set reward.signature: trl or trlx"),
])
def test_ambiguous_signatures_are_refused_with_the_fix(fn, message):
    with pytest.raises(RewardSignatureError, match=message):
        detect_signature(fn, "f")


def test_an_explicit_signature_settles_it_and_is_checked():
    ambiguous = lambda prompts, **kw: [0.0] * len(prompts)  # noqa: E731
    assert detect_signature(ambiguous, "f", "trl") == "trl"
    with pytest.raises(RewardSignatureError, match=r"'f' is called with the trlx signature.*takes 1 positional "
                                                   r"parameter\(s\) \(prompts\).*reward.signature: trl"):
        detect_signature(ambiguous, "f", "trlx")
    with pytest.raises(RewardSignatureError, match=r"'f': parameter 'x' is positional-only and has no default, "
                                                   r"and the trl signature has no value for it"):
        detect_signature(lambda x, /, **kw: [], "f", "trl")
    with pytest.raises(RewardSignatureError, match=r"takes 1 positional parameter\(s\) \(samples\)"):
        detect_signature(lambda samples, **kw: [], "f")  # trlx passes three lists positionally
    with pytest.raises(ConfigError, match="reward.signature must be one of auto, trlx, trl"):
        detect_signature(trlx_fn, "f", "trxl")


def test_resolve_sets_each_functions_signature_and_reward_signature_forces_one():
    cfg = load_config({"reward": {"fns": [{"fn": "tests.helpers.rewards:hashed"},
                                          {"fn": "tests.unit.test_reward_signature:think_format_reward"}]}})
    assert [nf.signature for nf in resolve_reward_fns(cfg.reward)] == ["trlx", "trl"]
    forced = load_config({"reward": {"fn": "tests.unit.test_reward_signature:keywords_only", "signature": "trl"}})
    assert resolve_reward_fns(forced.reward)[0].signature == "trl"
    with pytest.raises(RewardSignatureError, match="'keywords_only' is called with the trlx signature"):
        resolve_reward_fns(load_config({"reward": {"fn": "tests.unit.test_reward_signature:keywords_only",
                                                   "signature": "trlx"}}).reward)
    with pytest.raises(ConfigError, match="reward.signature: trl is for reward functions that run in this process"):
        load_config({"reward": {"url": "http://127.0.0.1:9", "signature": "trl"}})


# ---- the arguments ---------------------------------------------------------------------------------

MSGS = [{"role": "user", "content": "2+3?"}]


def _samples(chat: bool) -> Samples:
    meta = [{"answer": "5", "id": 0}, {"answer": "7", "id": 1}]
    if chat:
        meta = [m | {"prompt_messages": MSGS} for m in meta]
    return Samples(["<|user|>2+3?\n<|assistant|>"] * 2 if chat else ["2+3?"] * 2, [" 5", "8"], [[9], [4, 4]], meta)


def test_trl_arguments_for_conversational_prompts_are_messages():
    args, kw = call_arguments(answer_reward, "trl", _samples(chat=True), tokenizer=object())
    assert args == ()
    assert kw["prompts"] == [MSGS, MSGS]  # the messages, not the rendered text
    assert kw["completions"] == [[{"role": "assistant", "content": " 5"}], [{"role": "assistant", "content": "8"}]]
    assert kw["completion_ids"] == [[9], [4, 4]] and kw["answer"] == ["5", "7"] and kw["id"] == [0, 1]
    assert set(kw) == {"prompts", "completions", "completion_ids", "answer", "id"}  # no tokenizer, no samples


def test_trl_arguments_for_plain_prompts_are_strings():
    _, kw = call_arguments(answer_reward, "trl", _samples(chat=False), tokenizer=None)
    assert kw["prompts"] == ["2+3?", "2+3?"] and kw["completions"] == [" 5", "8"]


def test_trlx_arguments_are_unchanged():
    tok = object()
    args, kw = call_arguments(trlx_fn, "trlx", _samples(chat=False), tok)
    assert args == (["2+3? 5", "2+3?8"], ["2+3?", "2+3?"], [" 5", "8"])
    assert kw == {"answer": ["5", "7"], "id": [0, 1], "output_token_ids": [[9], [4, 4]], "tokenizer": tok}


def test_a_function_without_kwargs_gets_only_what_it_names():
    def strict(completions, answer):
        return [float(a in c) for c, a in zip(completions, answer)]

    _, kw = call_arguments(strict, "trl", _samples(chat=False), None)
    assert kw == {"completions": [" 5", "8"], "answer": ["5", "7"]}
    rewards, _ = score_samples([NamedRewardFn("strict", strict, signature="trl")], _samples(chat=False), None, None)
    assert [r.score for r in rewards] == [1.0, 0.0]


def test_trl_functions_score_through_the_reward_step():
    """TRL-style functions, a library-like one returning None included, async too, weighted and summed."""
    fns = [NamedRewardFn("acc", accuracy_reward, 2.0), NamedRewardFn("long", SoftOverlong(), 0.5),
           NamedRewardFn("len", async_reward)]
    s = _samples(chat=True)
    s = Samples(s.prompts, s.outputs, s.output_token_ids,
                [m | {"solution": sol} for m, sol in zip(s.metadata, ["5", None])])
    rewards, stats = RewardStep(fns, "main")(s)
    assert stats.calls == 3
    # sample 0: acc 1.0 (x2), long 0 (1 token), len 1 (one message); sample 1: acc None (no say), long 0, len 1
    assert [(r.score, r.components, r.scorable) for r in rewards] == [
        (2.0 * 1.0 + 0.0 + 1.0, {"acc": 1.0, "long": 0.0, "len": 1.0}, True),
        (0.0 + 1.0, {"long": 0.0, "len": 1.0}, True)]


# ---- columns against the functions (what prepare_inputs runs at start) --------------------------


@pytest.mark.parametrize("column", ["outputs", "samples", "prompts", "tokenizer", "output_token_ids"])
def test_a_column_named_like_a_trlx_argument_is_refused(column):
    with pytest.raises(RewardSignatureError, match=rf"data.prompts: data column '{column}' has the name of an "
                                                   rf"argument rallyrl passes to reward function 'f' \(trlx "
                                                   rf"signature.*rename the column \(if it holds the prompts, set "
                                                   rf"data.prompt_column: {column}\)"):
        check_columns(trlx_fn, "f", "trlx", ["answer", column], "data.prompts")


@pytest.mark.parametrize("column", ["prompts", "completions", "completion_ids"])
def test_a_column_named_like_a_trl_argument_is_refused(column):
    with pytest.raises(RewardSignatureError, match=rf"data column '{column}' .* reward function 'f' \(trl signature"):
        check_columns(think_format_reward, "f", "trl", [column], "data.prompts")


def test_column_checks_of_the_positional_parameters_and_required_arguments():
    # the issue's failure, with the trlx signature forced: answer is filled with the prompts AND the column
    with pytest.raises(RewardSignatureError, match=r"data column 'answer' is also reward function 'acc''s "
                                                   r"positional parameter 'answer', which the trlx signature fills "
                                                   r"with prompts; .*set reward.signature: trl"):
        check_columns(answer_reward, "acc", "trlx", ["answer"], "data.prompts")
    check_columns(answer_reward, "acc", "trl", ["answer"], "data.prompts")  # fine the TRL way
    with pytest.raises(RewardSignatureError, match=r"data.prompts: reward function 'acc' \(trl signature\) requires "
                                                   r"the argument 'answer', .*nor a data column \(its columns: "
                                                   r"label\); name the column so"):
        check_columns(answer_reward, "acc", "trl", ["label"], "data.prompts")
    needs_state = lambda completions, trainer_state, **kw: []  # noqa: E731
    with pytest.raises(RewardSignatureError, match=r"requires 'trainer_state' \(TRL's trainer state\), which "
                                                   r"rallyrl does not pass; give the parameter a default"):
        check_columns(needs_state, "f", "trl", [], "data.prompts")
    # a plain (not conversational) set's own prompt_messages column would be read as the messages
    with pytest.raises(RewardSignatureError, match="data column 'prompt_messages'"):
        check_columns(think_format_reward, "f", "trl", ["prompt_messages"], "data.prompts", chat=False)
    check_columns(think_format_reward, "f", "trl", ["prompt_messages"], "data.prompts", chat=True)  # rallyrl's


def test_a_collision_without_a_start_check_fails_at_the_call_naming_the_column():
    """RewardStep used directly (or a reward server): nothing checked the columns before, so the call does."""
    from rallyrl.reward import RewardError

    s = Samples(["p"], ["o"], [[1]], [{"tokenizer": "mine"}])
    with pytest.raises(RewardError, match=r"metadata column 'tokenizer' has the name of an argument rallyrl passes "
                                          r"to a trlx-signature reward function"):
        RewardStep([NamedRewardFn("f", trlx_fn)], "main")(s)
    assert passed_names("trl") == ("prompts", "completions", "completion_ids")


# ---- at start, through prepare_inputs (what `rallyrl check` and `train` run before any model loads)


def _cfg(tiny_model, prompts, **reward):
    return load_config({"model": {"path": str(tiny_model)}, "data": {"prompts": prompts},
                        "rollout": {"num_rollouts": 2, "chunk_size": 2}, "reward": reward})


def test_the_issue_cases_at_start(tiny_model):
    from rallyrl.inputs import prepare_inputs

    rows = [{"prompt": "2+3=", "answer": "5"}, {"prompt": "1+1=", "answer": "2"}]
    # 1. `def accuracy_reward(completions, answer, **kwargs)`: recognised as TRL's and accepted
    inp = prepare_inputs(_cfg(tiny_model, rows, fn="tests.unit.test_reward_signature:answer_reward"), 1)
    assert inp.reward_fns[0].signature == "trl"
    # 2. a column named `outputs`, 3. one named `tokenizer` (it used to be replaced by the tokenizer)
    for column in ("outputs", "tokenizer"):
        bad = [{"prompt": r["prompt"], column: r["answer"]} for r in rows]
        with pytest.raises(RewardSignatureError, match=rf"data.prompts: data column '{column}' has the name of an "
                                                       rf"argument rallyrl passes to reward function 'hashed'"):
            prepare_inputs(_cfg(tiny_model, bad, fn="tests.helpers.rewards:hashed"), 1)
    # the eval prompts are checked too, and the metric function against them
    cfg = _cfg(tiny_model, rows, fn="tests.unit.test_reward_signature:answer_reward")
    with pytest.raises(RewardSignatureError, match=r"eval_prompts: .*requires the argument 'answer'"):
        prepare_inputs(cfg, 1, eval_prompts=["no answer column"])
    with pytest.raises(RewardSignatureError, match=r"eval_prompts: data column 'tokenizer' .* the metric function "
                                                   r"'eval.metric_fn'"):
        prepare_inputs(cfg, 1, eval_prompts=[{"prompt": "x", "answer": "1", "tokenizer": 1}],
                       metric_fn=trlx_fn)


def test_trls_own_library_functions_run_unchanged():
    """TRL's library rewards themselves, where TRL is installed (it is not a dependency of rallyrl; the
    functions above have the same signatures and run everywhere)."""
    trl_rewards = pytest.importorskip("trl.rewards")
    fns = [NamedRewardFn("think", trl_rewards.think_format_reward),
           NamedRewardFn("overlong", trl_rewards.get_soft_overlong_punishment(4, 2)),
           NamedRewardFn("repetition", trl_rewards.get_repetition_penalty_reward(2, -1.0))]
    s = Samples(["q"] * 2, ["<think>a</think>b", "b b b"], [[1, 2, 3], [7, 7, 7, 7, 7]],
                [{"prompt_messages": MSGS}, {"prompt_messages": MSGS}])
    rewards, _ = RewardStep(fns)(s)  # signature None: read from the parameters at the call
    # think: 1, 0; overlong (max 4, cache 2): 3 tokens -> (2 - 3) / 2 = -0.5, 5 tokens -> -1;
    # repetition (2-grams, max -1): no repeat -> 0; 4 equal 2-grams -> (1 - 1/4) * -1 = -0.75
    assert [r.components for r in rewards] == [{"think": 1.0, "overlong": -0.5, "repetition": 0.0},
                                               {"think": 0.0, "overlong": -1.0, "repetition": -0.75}]
    try:
        import math_verify  # noqa: F401  (accuracy_reward needs it)
    except ImportError:
        return
    solution = [r"\frac{1}{3}", "no latex here"]  # an unparseable gold answer: TRL's accuracy_reward says None
    s = Samples(["q"] * 2, [r"\boxed{\frac{1}{3}}", "x"], [[1], [2]],
                [{"prompt_messages": MSGS, "solution": sol} for sol in solution])
    rewards, _ = RewardStep([NamedRewardFn("acc", trl_rewards.accuracy_reward)])(s)
    assert [(r.scorable, r.total) for r in rewards] == [(True, 1.0), (False, None)]
