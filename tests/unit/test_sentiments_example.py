"""examples/sentiments: the shipped config loads, its files exist, the reward scores text as VADER does."""

import json
from pathlib import Path

import pytest

from rallyrl.config import load_config
from rallyrl.data import load_prompts
from rallyrl.reward.loading import load_callable

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "sentiments"


@pytest.fixture(autouse=True)
def from_repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # the config's paths are relative to the repository root, as documented


def test_shipped_config_loads_and_names_files_that_exist():
    cfg = load_config(EXAMPLE / "config.yaml")
    assert cfg.reward.placement == "main"
    assert cfg.model.path == ".cache/sentiments/smollm2-135m-instruct"
    for spec in (cfg.reward.fn, cfg.eval.metric_fn, cfg.model.prepare):
        assert callable(load_callable(spec, "test"))
    records = load_prompts(cfg.data.prompts)
    assert len(records) == 256 and {r["label"] for r in records} == {"fresh", "rotten"}
    assert len(load_prompts(cfg.data.eval_prompts)) == 32
    assert cfg.rollout.num_rollouts % 2 == 0  # splits evenly over the 2 processes the README uses


def test_prompts_are_five_word_openings_and_eval_prompts_are_held_out():
    train = [json.loads(line) for line in (EXAMPLE / "prompts.jsonl").read_text().splitlines()]
    held_out = [json.loads(line) for line in (EXAMPLE / "eval_prompts.jsonl").read_text().splitlines()]
    assert all(len(r["prompt"].split()) == 5 for r in train + held_out)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}


def test_reward_is_the_vader_compound_score_of_the_continuation_only():
    pytest.importorskip("vaderSentiment")
    reward_fn = load_callable("examples/sentiments/task.py:reward_fn")
    outputs = [" a wonderful, moving film. I loved it!", " dull, boring and a waste of time.",
               " the cast includes three actors.", ""]
    prompts = ["This movie is awful:"] * 4  # negative prompt: must not count
    scores = reward_fn([p + o for p, o in zip(prompts, outputs)], prompts, outputs)
    assert len(scores) == 4 and all(isinstance(s, float) and -1.0 <= s <= 1.0 for s in scores)
    assert scores[0] > 0.5 and scores[1] < -0.5 and scores[2] == 0.0 and scores[3] == 0.0
    # the same numbers as VADER itself gives (the bundled lexicon, no download)
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

    vader = SentimentIntensityAnalyzer()
    assert scores == [vader.polarity_scores(o)["compound"] for o in outputs]


def test_metric_fn_reports_sentiment_and_share_positive():
    pytest.importorskip("vaderSentiment")
    metric_fn = load_callable("examples/sentiments/task.py:metric_fn")
    out = metric_fn(None, ["x"] * 3, [" great fun", " terrible", " a film"])
    assert set(out) == {"sentiment", "positive"}
    assert out["positive"] == [1.0, 0.0, 0.0]
    assert out["sentiment"][0] > 0.05 > out["sentiment"][2] > out["sentiment"][1]
