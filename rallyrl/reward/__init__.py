"""Reward functions, the central reward step, and the HTTP reward client (the server is ``.server``)."""

from .client import RemoteReward, RemoteRewardError
from .hf import HFClassifierError, HFClassifierReward, hf_classifier
from .samples import NamedRewardFn, Reward, Samples, StepStats, concat_shards, micro_batches, split_by_counts
from .signature import RewardSignatureError
from .step import Failure, RewardError, RewardHandle, RewardStep
from .validate import RewardValidationError, validate_rewards

__all__ = ["Failure", "HFClassifierError", "HFClassifierReward", "NamedRewardFn", "RemoteReward",
           "RemoteRewardError", "Reward", "RewardError", "RewardHandle", "RewardSignatureError", "RewardStep",
           "RewardValidationError",
           "Samples", "StepStats", "concat_shards", "hf_classifier", "micro_batches", "split_by_counts",
           "validate_rewards"]
