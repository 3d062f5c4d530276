"""Reward functions and the central reward step."""

from .step import NamedRewardFn, Reward, RewardError, RewardStep, Samples
from .validate import RewardValidationError, validate_rewards

__all__ = ["NamedRewardFn", "Reward", "RewardError", "RewardStep", "Samples", "RewardValidationError",
           "validate_rewards"]
