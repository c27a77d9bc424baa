"""Which process of a distributed job this is: rank, world size and local rank, read one way everywhere.

Extraction, training and the loader each split work by rank; reading the rank three ways (torchrun's
environment in one place, the process group in another, the environment with other defaults in a third)
lets two of them disagree about who does what. Order: what the caller passes, then an initialised
``torch.distributed`` process group, then torchrun's variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``),
then a single process. ``World`` is the value that carries all of it (with the node and the DataLoader
worker) to the loader.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, replace


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


def launcher_rank() -> int:
    """This process's rank as its launcher set it (torchrun's ``RANK``; 0 alone), read without torch: for the
    checks a command makes before it loads anything (``rank_and_world`` once a process group may exist)."""
    return rank_and_world(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)))[0]


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


@dataclass(frozen=True)
class World:
    """Where one reader sits in a job, every coordinate named once: ``rank`` of ``world`` ranks, on ``node`` of
    ``nodes`` (ranks numbered node by node, as torchrun numbers them), DataLoader ``worker`` of ``workers`` on its
    rank (0 of 1 outside a worker). The loader's plan, its resume state and its slot are all cut by this value,
    so they cannot disagree about who reads what (the convention of MosaicML Streaming's ``World``)."""

    rank: int = 0
    world: int = 1
    node: int = 0
    nodes: int = 1
    worker: int = 0
    workers: int = 1

    def __post_init__(self) -> None:
        if self.world < 1 or not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} out of range for world size {self.world}")
        if self.nodes < 1 or self.world % self.nodes or self.node != self.rank // (self.world // self.nodes):
            raise ValueError(f"rank {self.rank} of {self.world} is not on node {self.node} of {self.nodes} "
                             "(ranks are numbered node by node, the same count on every node)")
        if self.workers < 1 or not 0 <= self.worker < self.workers:
            raise ValueError(f"no worker {self.worker} of {self.workers}")

    @property
    def ranks_per_node(self) -> int:
        return self.world // self.nodes

    @property
    def slot(self) -> int:
        """This reader's index among all ``world * workers`` readers: ``rank * workers + worker``."""
        return self.rank * self.workers + self.worker

    @classmethod
    def detect(cls, rank: int | None = None, world: int | None = None, ranks_per_node: int | None = None,
               node: int | None = None, by_node: bool = True) -> World:
        """This process's world (``rank_and_world``, ``node_of``; values given win) and, inside a DataLoader
        worker, its worker. ``by_node=False``: the whole world counts as one node (a plan that does not split
        by node reads no node variables)."""
        rank, world = rank_and_world(rank, world)
        node, nodes, _ = node_of(rank, world, ranks_per_node, node) if by_node else (0, 1, world)
        return cls(rank, world, node, nodes).in_worker()

    @classmethod
    def of_slot(cls, slot: int, world: int, workers: int, nodes: int = 1) -> World:
        """The reader of ``slot`` in a world of ``world`` ranks x ``workers`` workers (a saved state's slots)."""
        return cls(0, world, 0, nodes).at(slot // workers, slot % workers, workers)

    def at(self, rank: int | None = None, worker: int | None = None, workers: int | None = None) -> World:
        """Another reader of this world: ``rank`` (default: this one), DataLoader ``worker`` of ``workers``
        (default: this one's); its node follows from its rank."""
        rank = self.rank if rank is None else int(rank)
        workers = self.workers if workers is None else int(workers)
        worker = (self.worker if workers == self.workers else 0) if worker is None else int(worker)
        node = rank // self.ranks_per_node if 0 <= rank < self.world else -1  # out of range: __post_init__ says so
        return replace(self, rank=rank, node=node, worker=worker, workers=workers)

    def in_worker(self) -> World:
        """This world seen from the calling process: the DataLoader worker it is (torch's ``get_worker_info``),
        or worker 0 of 1 outside one."""
        torch_data = sys.modules.get("torch.utils.data")  # not loaded: no DataLoader worker can be running
        info = torch_data.get_worker_info() if torch_data is not None else None
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return replace(self, worker=worker, workers=workers)
