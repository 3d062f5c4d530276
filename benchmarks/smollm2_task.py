"""The SmolLM2 row's task: continue short review openers; reward = VADER sentiment of the sample.

``reward_fn`` is a cheap, deterministic Python reward (the VADER lexicon, package ``vaderSentiment``):
the compound polarity in [-1, 1] of the whole sample (prompt + output). Both systems score exactly this
function on the text they decode (rallyrl passes samples; TRL's adapter decodes prompt + response
tokens, see ``TextRewardModel``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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


def make_text_reward_model(tokenizer: Any, score_texts: Callable[[list[str]], list[float]]) -> Any:
    """A Python text reward as the ``nn.Module`` TRL's PPOTrainer wants, and nothing more.

    TRL's ``get_reward(model, query_responses, pad_token_id, context_length)`` calls
    ``getattr(model, model.base_model_prefix)(input_ids=..., attention_mask=..., ...)``, then
    ``model.score(output.hidden_states[-1])`` -> (B, L, 1), and reads each row at its last response
    token. The "backbone" decodes each row's real tokens (``attention_mask``; special tokens skipped, as
    rallyrl decodes) to text, scores the texts in one call and writes each score at every position;
    ``score`` is the identity. ``calls``, ``samples`` and ``seconds`` count the reward work.
    """
    import time

    import torch
    from torch import nn

    class _DecodeAndScore(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.calls, self.samples, self.seconds = 0, 0, 0.0

        def forward(self, input_ids, attention_mask, **_: Any):  # noqa: ANN001
            t0 = time.perf_counter()
            texts = [tokenizer.decode(row[m].tolist(), skip_special_tokens=True)
                     for row, m in zip(input_ids, attention_mask.bool())]
            s = torch.tensor(score_texts(texts), dtype=torch.float32, device=input_ids.device)
            hidden = s[:, None, None].expand(input_ids.shape[0], input_ids.shape[1], 1)  # (B, L, 1)
            self.calls += 1
            self.samples += len(texts)
            self.seconds += time.perf_counter() - t0
            return type("Out", (), {"hidden_states": (hidden,)})()

    class TextRewardModel(nn.Module):
        base_model_prefix = "backbone"

        def __init__(self) -> None:
            super().__init__()
            self.backbone = _DecodeAndScore()
            self.score = nn.Identity()

    return TextRewardModel()
