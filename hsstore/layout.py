"""Shard layouts (the manifest's ``layout``): the one place that tells them apart.

Manifest, commit records, the sample index, the loader and ``info`` are shared by all layouts; a
layout only says how one shard's samples become objects, how a token range of a shard is read back,
and how ``verify`` checks a shard. ``zarr``: one Zarr v3 group of chunked arrays per shard (the
default, compressible, chunk cache). ``wds``: one WebDataset tar of ``.npy`` members per shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Layout:
    name: str
    # (fs, root, name, writer, manifest, features, input_ids, loss_mask, samples, stats) -> unpublished CommitRecord
    write_shard: Callable
    # (store, record, start, stop, layers, ids, mask, feats, carry, scales): fill the destinations (scales: the
    # fp8 per-row scales, or None), check every byte read
    read_into: Callable
    # (store, fs, root, record, report, progress, tails=None): verify's checks of one committed shard, whose
    # files are in (fs, root) (another store's for a shard merged by reference); tails: see upgrade
    check_shard: Callable
    # objects written once, with the manifest, when a store is created
    store_objects: Callable[[], dict[str, bytes]]
    # an entry of shards/ -> the shard it belongs to (None: not a shard), for verify's debris listing
    shard_of: Callable[[str], "str | None"]


def get(name: str) -> Layout:
    from . import reader, shard, verify, wds  # here: reader and verify use this module

    if name == "zarr":
        return Layout("zarr", shard.write_shard, reader.Store._read_zarr_into, verify.check_zarr_shard,
                      shard.parent_groups,
                      lambda entry: None if entry == "zarr.json" else entry)
    if name == "wds":
        return Layout("wds", wds.write_shard, wds.read_into, verify.check_tar_shard, dict,
                      lambda entry: entry[:-len(".tar")] if entry.endswith(".tar") else None)
    raise ValueError(f"unknown shard layout {name!r}")
