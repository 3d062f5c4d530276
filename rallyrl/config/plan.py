"""The batch plan: the batch arithmetic of a run, derived once from the config and the world size, with
exact division and errors that say which keys to change (lm-human-preference-details `exact_div`)."""

from __future__ import annotations

from dataclasses import dataclass

from .fields import ConfigError
from .root import Config


@dataclass(frozen=True)
class BatchPlan:
    """Batch arithmetic, derived once from the config and the world size.

    ``num_rollouts`` global samples are split over ``world_size`` ranks as evenly as possible (the first
    ``num_rollouts % world_size`` ranks get one more). Every rank runs the same number of chunk rounds
    (``rounds``) so the central reward step is entered the same number of times everywhere; in a round a
    rank may have fewer samples than ``chunk_size``, even none.
    """

    world_size: int
    num_rollouts: int
    chunk_size: int
    local_counts: tuple[int, ...]
    rounds: int
    num_minibatches: int
    epochs: int
    samples_per_prompt: int = 1  # G: consecutive global samples [g*G, (g+1)*G) are group g's members

    @property
    def prompts_per_iteration(self) -> int:
        return self.num_rollouts // self.samples_per_prompt

    def sample_prompts(self, prompt_indices: list[int]) -> list[int]:
        """The global batch's prompt index per sample: each drawn prompt repeated G times in a row, so
        sample ``i`` belongs to group ``i // G`` (the group id), as member ``i % G``."""
        return [p for p in prompt_indices for _ in range(self.samples_per_prompt)]

    @property
    def optimizer_steps_per_iteration(self) -> int:
        return self.epochs * self.num_minibatches

    def local_count(self, rank: int) -> int:
        return self.local_counts[rank]

    def offset(self, rank: int) -> int:
        """Index of this rank's first sample in the global (rank-major) order."""
        return sum(self.local_counts[:rank])

    def round_counts(self, rank: int, round_idx: int) -> int:
        """Samples this rank generates in chunk round ``round_idx``."""
        n = self.local_counts[rank]
        return max(0, min(self.chunk_size, n - round_idx * self.chunk_size))


def split_evenly(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (1 if r < extra else 0) for r in range(parts)]


def make_batch_plan(cfg: Config, world_size: int) -> BatchPlan:
    g = cfg.rollout.num_rollouts
    if g < world_size:
        raise ConfigError(
            f"rollout.num_rollouts={g} is smaller than the number of processes ({world_size}); "
            f"every rank needs at least one sample"
        )
    counts = split_evenly(g, world_size)
    smallest = min(counts)
    if cfg.ppo.num_minibatches > smallest:
        raise ConfigError(
            f"ppo.num_minibatches={cfg.ppo.num_minibatches} exceeds the smallest per-rank batch "
            f"({smallest} = rollout.num_rollouts {g} split over {world_size} processes); every rank must "
            f"take the same number of optimizer steps"
        )
    if cfg.model.sharding == "fsdp" and world_size > 1:
        _check_equal_micro_batches(cfg, counts)
    rounds = -(-max(counts) // cfg.rollout.chunk_size)
    return BatchPlan(
        world_size=world_size,
        num_rollouts=g,
        chunk_size=cfg.rollout.chunk_size,
        local_counts=tuple(counts),
        rounds=rounds,
        num_minibatches=cfg.ppo.num_minibatches,
        epochs=cfg.ppo.epochs,
        samples_per_prompt=cfg.rollout.samples_per_prompt,
    )


def _check_equal_micro_batches(cfg: Config, counts: list[int]) -> None:
    """Under FSDP every forward and backward of the update is a collective (weights are gathered block
    by block), so every rank must run the same number of micro-batches in each optimizer step. A rank's
    minibatches are its samples split as evenly as possible (``torch.tensor_split``), each cut into
    micro-batches of ``ppo.micro_batch_size``."""
    M, mbs = cfg.ppo.num_minibatches, cfg.ppo.micro_batch_size
    per_rank = {tuple(-(-s // (mbs or s)) for s in split_evenly(n, M)) for n in counts}
    if len(per_rank) > 1:
        raise ConfigError(
            f"model.sharding=fsdp: with rollout.num_rollouts={cfg.rollout.num_rollouts} over {len(counts)} "
            f"processes ({'/'.join(map(str, counts))} samples per rank), ppo.num_minibatches={M} and "
            f"ppo.micro_batch_size={mbs}, ranks would run different numbers of micro-batches per optimizer "
            f"step ({' vs '.join(str(list(p)) for p in sorted(per_rank))}); under FSDP every forward is a "
            f"collective. Make rollout.num_rollouts a multiple of the process count, or raise or unset "
            f"ppo.micro_batch_size")

