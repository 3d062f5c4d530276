"""The SmolLM2 row's task: continue short review openers; reward = VADER sentiment of the sample.

``reward_fn`` is a cheap, deterministic Python reward (the VADER lexicon, package ``vaderSentiment``):
the compound polarity in [-1, 1] of the whole sample (prompt + output). Both systems score exactly this
function on the text they decode (rallyrl passes samples; TRL's adapter decodes prompt + response
tokens: ``benchmarks.common.make_text_reward_model``, shared with the randomwalks row).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

TRAIN_PROMPTS = [
    "The movie was", "I watched this film and", "The acting in this show", "My honest review:",
    "The story of the film", "Last night we saw a movie that", "The director", "This sequel is",
    "The soundtrack", "Overall, the film", "The ending of the movie", "I expected the plot to",
    "The main character", "Compared to the book, the movie", "The special effects", "My friends said the film",
]
EVAL_PROMPTS = [
    "The cinema was", "This documentary", "The cast of the film", "After the credits rolled, I",
    "The first half of the movie", "The dialogue", "I would describe the film as", "The critics said",
]

_ANALYZER: Any = None


def _analyzer() -> Any:
    global _ANALYZER
    if _ANALYZER is None:
        from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

        _ANALYZER = SentimentIntensityAnalyzer()
    return _ANALYZER


def sentiment(texts: Sequence[str]) -> list[float]:
    a = _analyzer()
    return [float(a.polarity_scores(t)["compound"]) for t in texts]


def reward_fn(samples: Sequence[str], prompts: Sequence[str], outputs: Sequence[str], **_: Any) -> list[float]:
    return sentiment(samples)


from benchmarks.common import make_text_reward_model  # noqa: E402,F401  (TRL's adapter; re-exported)
