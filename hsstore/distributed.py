"""Which process of a distributed job this is: rank, world size and local rank, read one way everywhere.

Extraction, training and the loader each split work by rank; reading the rank three ways (torchrun's
environment in one place, the process group in another, the environment with other defaults in a third)
lets two of them disagree about who does what. Order: what the caller passes, then an initialised
``torch.distributed`` process group, then torchrun's variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``),
then a single process.
"""

from __future__ import annotations

import os


def rank_and_world(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """(rank, world size) of this process; values given win. Raises when the rank is outside the world."""
    if rank is None or world_size is None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            rank = dist.get_rank() if rank is None else rank
            world_size = dist.get_world_size() if world_size is None else world_size
    rank = int(os.environ.get("RANK", 0)) if rank is None else int(rank)
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else int(world_size)
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} out of range for world size {world_size}")
    return rank, world_size


def local_rank(rank: int, world_size: int) -> int:
    """This process's index on its machine (its GPU): torchrun's ``LOCAL_RANK``; without it, the rank itself
    when the whole world fits on this machine's GPUs (several ranks started by hand on one machine), else 0."""
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    import torch

    return rank if world_size <= max(torch.cuda.device_count(), 1) else 0
