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
