"""The seam between a store and its layout (hsstore/layouts/source.py): layouts never see the ``Store``; the
chunk cache reaches reads through the public ``Store.use_chunk_cache``, per process, never pickled; the
source's filesystem is this process's after a fork."""

from __future__ import annotations

import ast
import os
import pickle
from pathlib import Path

import pytest
import torch

import hsstore
from hsstore.layouts import base as layout
from hsstore.loader.cache import ChunkCache
from hsstore.errors import StoreError

from conftest import make_manifest, make_samples, write_samples

PACKAGE = Path(hsstore.__file__).parent


@pytest.mark.parametrize("name", sorted(layout.names()))
def test_layouts_import_neither_the_reader_nor_the_loader(name):
    """A layout gets a ShardSource; the Store (store/reader.py) and the loader are beyond the seam."""
    mod = layout.get(name)
    tree = ast.parse(Path(mod.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    beyond = {"store", "store.reader", "loader", "loader.dataset", "hsstore.store.reader", "hsstore.loader"}
    assert not imported & beyond, imported


def test_chunk_cache_through_the_public_call_per_process_and_never_pickled(s3_store, tmp_path):
    url, opts = s3_store
    samples = make_samples(6)
    write_samples(url, make_manifest(chunk_tokens=50), samples, storage_options=opts)
    store = hsstore.open(url, **opts)
    assert store.chunk_cache is None and store.source.chunk_cache is None
    cache = ChunkCache(str(tmp_path / "cache"), 1 << 30)
    store.use_chunk_cache(cache)
    assert store.chunk_cache is cache and store.source.chunk_cache is cache
    first = store.read(0)
    assert cache.misses > 0 and cache.hits == 0 and cache.size() > 0
    again = store.read(0)
    assert cache.hits > 0 and all(torch.equal(first[k], again[k]) for k in ("input_ids", "hidden_states"))
    copy = pickle.loads(pickle.dumps(store))  # what a spawned DataLoader worker gets: no cache, a fresh fs
    assert copy.chunk_cache is None and copy.source.chunk_cache is None
    assert torch.equal(copy.read(0)["hidden_states"], first["hidden_states"])
    store.use_chunk_cache(None)
    hits = cache.hits
    store.read(0)
    assert cache.hits == hits  # no longer consulted


def test_locate_refuses_what_never_leaves_the_root(tmp_path):
    write_samples(str(tmp_path / "s"), make_manifest(), make_samples(3))
    store = hsstore.open(str(tmp_path / "s"))
    src = store.source
    shard = store.commits[0].shard
    fs, root, where = src.locate(shard)
    assert root == store.root and where == store.url and fs is store.fs
    for bad in ("../s", "a/b", ".."):
        with pytest.raises(StoreError, match="shard name"):
            src.locate(bad)
    os.symlink(str(tmp_path / "elsewhere"), os.path.join(store.root, "shards", "linked"))
    with pytest.raises(StoreError, match="linked"):
        src.locate("linked")


def test_source_filesystem_is_resolved_anew_after_a_fork(tmp_path):
    write_samples(str(tmp_path / "s"), make_manifest(), make_samples(3))
    store = hsstore.open(str(tmp_path / "s"))
    parent_fs = store.fs
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover  (child)
        ok = store.source.filesystem() is not parent_fs and store.read(0)["sample_id"] == "s0"
        os.write(w, b"1" if ok else b"0")
        os._exit(0)
    os.close(w)
    got = os.read(r, 1)
    os.close(r)
    os.waitpid(pid, 0)
    assert got == b"1" and store.fs is parent_fs
