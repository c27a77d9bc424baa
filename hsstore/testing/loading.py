"""Datasets over small stores for tests: the loader's options spelled flat (``rank=1, seed=3, skip_corrupt=True``)
and sorted into their groups by field name, so a test names only what it varies."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from torch.utils.data import DataLoader

from ..distributed import World
from ..loader.dataset import HiddenStateDataset
from ..loader.options import Planning, Reading, Selection
from .stores import TOKEN_BYTES

GROUPS = {"selection": Selection, "planning": Planning, "reading": Reading}
WORLD_KEYS = ("rank", "world_size", "ranks_per_node")


def grouped(**flat: Any) -> dict[str, Any]:
    """``HiddenStateDataset`` keyword arguments from flat ones: each option goes to the group that has a field
    of its name; ``rank``/``world_size``/``ranks_per_node`` make the ``world`` (``World.detect``); the rest
    (``storage_options``, ``share_metadata``, ``layers``) pass as they are. An unknown name is a TypeError."""
    out: dict[str, Any] = {}
    for name, cls in GROUPS.items():
        fields = {f.name for f in dataclasses.fields(cls)}
        mine = {k: flat.pop(k) for k in list(flat) if k in fields}
        if mine:
            out[name] = cls(**mine)
    world = {k: flat.pop(k) for k in WORLD_KEYS if k in flat}
    if world:
        by_node = out.get("planning", Planning()).partition == "node"
        out["world"] = World.detect(world.get("rank"), world.get("world_size"), world.get("ranks_per_node"),
                                    by_node=by_node)
    return {**out, **flat}


def dataset(url, **flat) -> HiddenStateDataset:
    """Small units (2 chunks) and a small shuffle pool, so the tiny stores have many units."""
    flat.setdefault("unit_bytes", TOKEN_BYTES * 128)
    flat.setdefault("shuffle_bytes", TOKEN_BYTES * 500)
    return HiddenStateDataset(url, **grouped(**flat))


def ids_of(items) -> list[str]:
    return [x["sample_id"] for x in items]


def collect(url, world, workers, ctx="fork", **flat) -> list[list[str]]:
    """Sample ids per rank through a real DataLoader."""
    out = []
    for r in range(world):
        ds = dataset(url, rank=r, world_size=world, **flat)
        loader = DataLoader(ds, batch_size=None, num_workers=workers,
                            multiprocessing_context=ctx if workers else None)
        got = ids_of(loader)
        assert len(got) == len(ds)
        out.append(got)
    return out


def StatefulDataLoader(*args, **kwargs):
    """torchdata's loader (the resume convention); tests using it skip where torchdata is not installed."""
    return pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader(*args, **kwargs)
