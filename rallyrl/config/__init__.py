"""Typed configuration: dataclasses, a strict loader, validation and the derived batch plan.

Every field has a default, a one-line ``doc`` and (a bounded number) its range in its metadata
(``fields._f``); ``docs/config.md`` is generated from these (``python -m rallyrl.config --markdown``) and
the JSON schema (``rallyrl schema``) reads the same ranges as ``validate``.

Strictness is the point (style rule 4): an unknown key, or a value of the wrong type, is a
``ConfigError`` naming the dotted key (with a "did you mean" suggestion) and it is raised before any
model is loaded.

The rooms, in the order a config goes through them:

- ``fields``: ``ConfigError``, the field helper ``_f`` (doc + range), the shared choice lists;
- ``model``, ``train``, ``algorithm``, ``reward``, ``env``: the section dataclasses; ``root``: ``Config``;
- ``yamlio``: YAML 1.2 reading (duplicate keys and 1.1/1.2-ambiguous scalars refused) and writing;
- ``loader``: ``--set`` overrides, coercion, unknown keys (``suggest``: did-you-mean, with the peers'
  option names of ``peers``);
- ``validate``: ranges and checks across fields, warnings;
- ``plan``: ``BatchPlan``; ``changes``: what differs between two configs;
- ``docs`` (docs/config.md) and ``schema`` (the JSON schema).
"""

from .algorithm import ENGINES, GenerationConfig, PPOConfig, RolloutConfig, VLLMConfig, engine_logprobs_exact
from .changes import FREE_TO_CHANGE, Change, config_changes, flat_config, format_changes
from .docs import config_markdown
from .env import EnvConfig
from .fields import DTYPES, REFERENCES, TRACKERS, ConfigError
from .loader import load_config, parse_overrides, read_text
from .model import DataConfig, LoraConfig, ModelConfig
from .plan import BatchPlan, make_batch_plan, split_evenly
from .reward import OverlongBufferConfig, RewardConfig, RewardFnSpec, reward_fn_name
from .root import Config
from .train import CheckpointConfig, DistConfig, EvalConfig, TrainConfig
from .validate import SERVER_ARGS, config_warnings, validate
from .yamlio import dump_yaml, load_yaml

__all__ = [
    "DTYPES", "FREE_TO_CHANGE", "REFERENCES", "SERVER_ARGS", "TRACKERS",
    "BatchPlan", "Change", "CheckpointConfig", "Config", "ConfigError", "DataConfig", "DistConfig", "EnvConfig",
    "EvalConfig", "GenerationConfig", "LoraConfig", "ModelConfig", "OverlongBufferConfig", "PPOConfig", "RewardConfig",
    "RewardFnSpec", "RolloutConfig", "TrainConfig", "VLLMConfig", "ENGINES", "engine_logprobs_exact",
    "config_changes", "config_markdown", "config_warnings", "dump_yaml", "flat_config", "format_changes", "load_config",
    "load_yaml", "make_batch_plan", "parse_overrides", "read_text", "reward_fn_name", "split_evenly", "validate",
]
