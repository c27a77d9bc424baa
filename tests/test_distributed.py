"""Rank and world size, read one way by extraction, training and the loader (hsstore/distributed.py)."""

import pytest

from hsstore.distributed import local_rank, rank_and_world


def test_torchrun_environment_and_given_values(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    assert rank_and_world() == (0, 1) and local_rank(0, 1) == 0
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert rank_and_world() == (3, 4) and local_rank(3, 4) == 1
    assert rank_and_world(1, 2) == (1, 2)  # a caller's values win over the environment
    assert rank_and_world(rank=2) == (2, 4)
    with pytest.raises(ValueError, match="rank 4 out of range for world size 4"):
        rank_and_world(rank=4)
    monkeypatch.setenv("WORLD_SIZE", "0")
    with pytest.raises(ValueError, match="out of range"):
        rank_and_world()


def test_extract_and_train_read_the_same_rank(monkeypatch):
    from hsstore.extract.job import dist_env
    from hsstore.train.launch import init_distributed

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    rank, world, device, group = init_distributed("cpu")
    assert (rank, world) == dist_env(None, None)[:2] == (0, 1) and group is None


def test_world_names_every_coordinate_once(monkeypatch):
    """``World``: detected from torchrun's variables (node by ``LOCAL_WORLD_SIZE``), every other reader of the same
    world reachable by ``at`` / ``of_slot`` with its node following its rank, and inconsistent coordinates refused
    where they are made."""
    from hsstore.distributed import World

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        monkeypatch.delenv(k, raising=False)
    assert World.detect() == World(0, 1, 0, 1, 0, 1)
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    w = World.detect()
    assert (w.rank, w.world, w.node, w.nodes, w.ranks_per_node, w.worker, w.workers) == (5, 8, 1, 2, 4, 0, 1)
    assert World.detect(by_node=False).nodes == 1  # a plan that does not split by node reads no node variables
    other = w.at(2, worker=1, workers=3)
    assert (other.rank, other.node, other.worker, other.workers, other.slot) == (2, 0, 1, 3, 7)
    assert World.of_slot(7, 8, 3, nodes=2) == other
    assert [World.of_slot(s, 4, 2).slot for s in range(8)] == list(range(8))
    with pytest.raises(ValueError, match="rank 8 out of range for world size 8"):
        w.at(8)
    with pytest.raises(ValueError, match="is not on node 0 of 2"):
        World(5, 8, 0, 2)
    with pytest.raises(ValueError, match="is not on node"):
        World(0, 6, 0, 4)  # 4 nodes do not divide 6 ranks
    with pytest.raises(ValueError, match="no worker 2 of 2"):
        World(0, 1, worker=2, workers=2)
    with pytest.raises(ValueError, match="ranks must be numbered node by node"):
        World.detect(rank=1, world=8, ranks_per_node=4, node=1)


def test_world_in_a_dataloader_worker_is_that_worker():
    """``in_worker`` inside a DataLoader worker process gives the worker's own coordinates (torch's
    ``get_worker_info``); outside one, worker 0 of 1."""
    from torch.utils.data import DataLoader, IterableDataset

    from hsstore.distributed import World

    class Where(IterableDataset):
        def __iter__(self):
            w = World(1, 2).in_worker()
            yield (w.rank, w.worker, w.workers, w.slot)

    assert World(1, 2).in_worker() == World(1, 2)
    got = sorted(tuple(x) for x in DataLoader(Where(), batch_size=None, num_workers=2, multiprocessing_context="fork"))
    assert got == [(1, 0, 2, 2), (1, 1, 2, 3)]
