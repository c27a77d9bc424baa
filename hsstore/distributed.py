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


def node_of(rank: int, world_size: int, ranks_per_node: int | None = None, node: int | None = None,
            ) -> tuple[int, int, int]:
    """(node index, node count, ranks per node) of ``rank``: what a node-affine loader splits by.

    Values given win, then torchrun's ``LOCAL_WORLD_SIZE`` and ``GROUP_RANK``; without them the whole
    world is one node. Ranks must be numbered node by node (rank = node * ranks_per_node + local rank,
    as torchrun numbers them): a node's ranks then split the node's share between themselves."""
    if ranks_per_node is None:
        ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    ranks_per_node = int(ranks_per_node)
    if ranks_per_node < 1 or world_size % ranks_per_node:
        raise ValueError(f"{ranks_per_node} ranks per node do not divide a world of {world_size} rank(s) "
                         "(nodes with different rank counts are not supported)")
    if node is None and "GROUP_RANK" in os.environ and ranks_per_node != world_size:
        node = int(os.environ["GROUP_RANK"])
    expected = rank // ranks_per_node
    if node is not None and int(node) != expected:
        raise ValueError(f"rank {rank} is on node {node}, but with {ranks_per_node} ranks per node it should be on "
                         f"node {expected}: ranks must be numbered node by node (as torchrun numbers them)")
    return expected, world_size // ranks_per_node, ranks_per_node
