"""rallyrl's distributed layer: the only code that talks to ``torch.distributed`` (DESIGN.md).

- ``collectives.py``: the process group's facts (``world_size``, ``rank``, ``is_main``, the ``stage`` a
  rank is in, the collective timeout) and every collective (the object and tensor collectives, ``agree``
  / ``raise_failures``, ``any_stop``, ``barrier``, ``shutdown``);
- ``accelerator.py``: the ``accelerate.Accelerator`` (``init_accelerator``) and what the trainer does to
  the trained model through it (``shard``, ``prepare``, ``gathered``, ``backward``, ``no_sync``,
  ``clip_grad_norm``, ``full_state_dict``): DDP, or FSDP2 through
- ``sharding.py``: the FSDP2 / DCP engine (sharding, loading straight into shards, gathered forwards,
  sharded checkpoints ``save_sharded`` / ``load_sharded``).

The rest of rallyrl calls ``dist.<name>``; these re-exports are that surface. Importing this package
imports no torch (each module holds a lazy ``torch``): the CLI and the ``--nproc`` launcher name ``dist``
without paying for torch until a collective runs.
"""

from .accelerator import (backward, clip_grad_norm, full_state_dict, gathered, init_accelerator, is_sharded,
                          no_sync, prepare, shard)
from .collectives import (agree, all_gather_objects, all_reduce_sum, any_stop, barrier, broadcast_object,
                          collective_device, colocated_engine_options, exchange_objects, expected_rank,
                          expected_world_size, gather_objects, is_distributed, is_main, keep_group_from,
                          local_world_size, rank, raise_failures, reduce_max, reduce_stats, scatter_objects,
                          set_timeout, shutdown, stage, timeout_error, world_size)
from .sharding import load_sharded, local_nbytes, save_sharded

__all__ = ["agree", "all_gather_objects", "all_reduce_sum", "any_stop", "backward", "barrier", "broadcast_object",
           "clip_grad_norm", "collective_device", "colocated_engine_options", "exchange_objects", "expected_rank", "expected_world_size",
           "full_state_dict",
           "gather_objects", "gathered", "init_accelerator", "is_distributed", "is_main", "is_sharded", "keep_group_from",
           "load_sharded", "local_nbytes", "local_world_size", "no_sync", "prepare", "raise_failures", "rank",
           "reduce_max", "reduce_stats", "save_sharded", "scatter_objects", "set_timeout", "shard", "shutdown", "stage",
           "timeout_error", "world_size"]
