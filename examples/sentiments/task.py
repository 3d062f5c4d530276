"""The sentiments task: reward = VADER compound sentiment of the continuation.

VADER (Hutto & Gilbert, ICWSM 2014; the ``vaderSentiment`` package, MIT, which ships its lexicon) is a
lexicon- and rule-based scorer: ``compound`` is a normalised score in [-1, 1], > 0.05 read as
positive, < -0.05 as negative. It stands in for the IMDB sentiment classifier of trlx's sentiments
example, which would need a hub download. Only the continuation (``outputs``) is scored, not the
review opening the model was given, so the reward measures what the policy wrote.

Both functions are plain Python on strings: cheap, so ``reward.placement: main`` (one call on rank 0
with every rank's samples) costs milliseconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any


@lru_cache(maxsize=1)
def _analyzer() -> Any:
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

    return SentimentIntensityAnalyzer()  # reads the bundled lexicon once per process


def vader_compound(texts: Sequence[str]) -> list[float]:
    """VADER compound score in [-1, 1] of each text (0.0 for text with no sentiment words)."""
    analyzer = _analyzer()
    return [float(analyzer.polarity_scores(t)["compound"]) for t in texts]


def reward_fn(samples: list[str], prompts: list[str], outputs: list[str], **kwargs: Any) -> list[float]:
    """One scalar reward per sample: the compound sentiment of the continuation."""
    return vader_compound(outputs)


def metric_fn(samples: list[str], prompts: list[str], outputs: list[str], **kwargs: Any) -> dict[str, list[float]]:
    """Evaluation metrics (logged as ``eval/<name>``): mean compound score, and the share of
    continuations VADER reads as positive (compound > 0.05, the threshold of the VADER paper)."""
    scores = vader_compound(outputs)
    return {"sentiment": scores, "positive": [1.0 if s > 0.05 else 0.0 for s in scores]}
