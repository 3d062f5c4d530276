"""`Config`: the whole tree, one field per section (the order of docs/config.md and the schema)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .algorithm import GenerationConfig, PPOConfig, RolloutConfig
from .env import EnvConfig
from .model import DataConfig, ModelConfig
from .reward import RewardConfig
from .train import CheckpointConfig, DistConfig, EvalConfig, TrainConfig
from .yamlio import dump_yaml


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    env: EnvConfig = field(default_factory=EnvConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return dump_yaml(self.to_dict())
