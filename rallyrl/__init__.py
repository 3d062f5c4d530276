"""rallyrl: RL fine-tuning (PPO, GRPO, RLOO) of Hugging Face language models with one central reward step.

Every rank generates its rollouts; all of them rally to one reward host, are scored in one batched
reward call, and each rank gets exactly its own rewards back.
"""

from .config import Config, ConfigError, load_config
from .reward.step import NamedRewardFn, RewardError
from .version import __version__
__all__ = ["Config", "ConfigError", "NamedRewardFn", "RemoteReward", "RewardError", "__version__", "load_config", "train"]


def train(*args, **kwargs):
    """Fine-tune with PPO, GRPO or RLOO; see ``rallyrl.trainer.train`` (imported lazily so `import rallyrl` stays cheap)."""
    from .trainer import train as _train

    return _train(*args, **kwargs)


def __getattr__(name: str):
    # `rallyrl.RemoteReward` is imported on first use: `import rallyrl` stays free of torch and httpx.
    if name == "RemoteReward":
        from .reward.client import RemoteReward

        return RemoteReward
    raise AttributeError(f"module 'rallyrl' has no attribute {name!r}")
