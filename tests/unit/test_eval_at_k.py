"""Evaluation with k samples per prompt: the pass@k estimator (hand values) and the per-prompt grouping."""

import random
from math import comb

import pytest

import rallyrl
from rallyrl.config import ConfigError
from rallyrl.evaluation import at_k_metrics, pass_at_k


@pytest.mark.parametrize("n, c, k, expected", [
    (5, 2, 2, 0.7),          # 1 - C(3,2)/C(5,2) = 1 - 3/10
    (5, 0, 2, 0.0),          # nothing passes
    (5, 5, 3, 1.0),          # everything passes
    (5, 1, 1, 0.2),          # pass@1 = c/n
    (10, 3, 1, 0.3),
    (10, 3, 5, 1 - 21 / 252),  # 1 - C(7,5)/C(10,5) = 1 - 21/252
    (4, 2, 3, 1.0),          # n - c = 2 < k = 3: every draw of 3 holds a pass
    (4, 1, 4, 1.0),          # n = k: 1 if any sample passes
    (4, 0, 4, 0.0),
])
def test_pass_at_k_hand_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_equals_the_binomial_form():
    for n in range(1, 12):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k), abs=1e-12)


@pytest.mark.parametrize("n, c, k", [(3, 1, 4), (3, 4, 1), (3, 1, 0), (3, -1, 1)])
def test_pass_at_k_rejects_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match="pass_at_k needs"):
        pass_at_k(n, c, k)


def test_at_k_metrics_group_by_prompt_id_in_any_order():
    # 3 prompts x k = 3 samples; prompt 0: one exact pass, prompt 1: none (0.9 is no pass), prompt 2: all
    values = {0: [1.0, 0.0, 0.0], 1: [0.0, 0.9, 0.0], 2: [1.0, 1.0, 1.0]}
    pairs = [(p, v) for p, vs in values.items() for v in vs]
    expected = {"eval/correct@3": 4.9 / 9, "eval/correct_pass@3": (1 + 0 + 1) / 3}
    for seed in range(5):  # the order samples arrive in (rank order, chunk rounds) does not matter
        random.Random(seed).shuffle(pairs)
        got = at_k_metrics("correct", [v for _, v in pairs], [p for p, _ in pairs], 3)
        assert got == pytest.approx(expected)


def test_at_k_metrics_only_for_values_in_unit_interval():
    assert at_k_metrics("length", [0.0, 2.0], [0, 0], 2) == {}
    assert at_k_metrics("x", [0.5, float("nan")], [0, 0], 2) == {}
    assert at_k_metrics("x", [-0.1, 1.0], [0, 0], 2) == {}
    assert at_k_metrics("x", [0.5, 1.0], [0, 0], 2) == {"eval/x@2": 0.75, "eval/x_pass@2": 1.0}


def test_config_samples_per_prompt():
    assert rallyrl.load_config({}).eval.samples_per_prompt == 1
    assert rallyrl.load_config({"eval": {"samples_per_prompt": 4, "do_sample": True}}).eval.samples_per_prompt == 4
    with pytest.raises(ConfigError, match=r"eval.samples_per_prompt=4 needs eval.do_sample: true"):
        rallyrl.load_config({"eval": {"samples_per_prompt": 4}})
    with pytest.raises(ConfigError, match=r"eval.samples_per_prompt must be > 0, got 0"):
        rallyrl.load_config({"eval": {"samples_per_prompt": 0}})
