"""Rollouts: generation engines, episodes, the training batch and the rollout-time scoring passes.

- ``engine.py``: the ``GenerationEngine`` protocol (token ids and a ``SamplingSpec`` in; sampled ids and,
  when asked, log-probs out; ``sync`` after each optimizer phase; a weight version on every sample).
- ``hf.py`` (+ ``prefill.py``): the Hugging Face engine, one for causal and seq2seq models.
- ``episode.py``: prompts -> finished ``Episodes`` by calling the engine (single turn by default).
- ``batch.py``: ``Rollouts`` with its two masks (attention and ``action_mask``), ``Advantages``, ``Shard``.
- ``scoring.py``: the policy / reference log-prob and value passes.
- ``collect.py``: the rollout stage of the loop (episodes, the central reward step, scoring).
"""

from .batch import Advantages, Rollouts, Shard
from .collect import collect_rollouts
from .engine import GenerationEngine, Sampled, SamplingSpec
from .episode import Episodes, run_episodes
from .hf import HFEngine, truncate_at_stop
from .padding import pad
from .prefill import prompt_index
from .scoring import Scored, score_tokens

__all__ = ["Advantages", "Episodes", "GenerationEngine", "HFEngine", "Rollouts", "Sampled", "SamplingSpec", "Scored",
           "Shard", "collect_rollouts", "pad", "prompt_index", "run_episodes", "score_tokens", "truncate_at_stop"]
