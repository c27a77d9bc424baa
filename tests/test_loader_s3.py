"""The loader against a real S3 endpoint (moto's server on loopback): forked workers after the parent
used s3fs, bytes fetched per layer, the local chunk cache (hits, cap, LRU eviction), a store deleted
mid-epoch."""

from __future__ import annotations

import collections
import contextlib
import os
import uuid

import pytest
import s3fs
import torch
from torch.utils.data import DataLoader

import hsstore
from hsstore.loader.cache import ChunkCache
from hsstore.errors import CorruptionError, StoreError
from hsstore.app.schema import build

from conftest import PATIENT_S3, make_samples, whole_object_fills
from test_loader import bits, dataset, ids_of, write_store
from test_loader_batching import assert_same_batches, direct_and_copied

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")


@pytest.fixture(scope="module")
def s3_samples():
    return make_samples(40, max_len=120)


@pytest.fixture(scope="module")
def s3_url(s3_endpoint, s3_samples):
    """One store for the read-only tests (writing to moto is the slow part)."""
    s3fs.S3FileSystem.clear_instance_cache()
    opts = {"endpoint_url": s3_endpoint, **PATIENT_S3}  # spawned workers read with these options
    bucket = f"hs-loader-{uuid.uuid4().hex[:8]}"
    s3fs.S3FileSystem(**opts).mkdir(bucket)
    url = f"s3://{bucket}/stores/a"
    write_store(url, s3_samples, shard_tokens=1000, storage_options=opts)
    return url, opts


@pytest.fixture
def fetched(monkeypatch):
    """Bytes fetched from S3 per array name (layer_003, input_ids, ...), in this process: the body sizes of
    s3fs's GetObject calls (whoever reads the body)."""
    counts: collections.Counter = collections.Counter()
    orig = s3fs.S3FileSystem._call_s3

    async def spy(self, method, *a, **k):
        resp = await orig(self, method, *a, **k)
        key = k.get("Key", "")
        if method == "get_object" and "/shards/" in key:
            counts[key.split("/shards/")[1].split("/")[1]] += int(resp["ContentLength"])
        return resp

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", spy)
    return counts


@pytest.mark.parametrize("ctx", ["fork", "spawn"])
def test_s3_exactly_once_workers_after_parent_used_s3fs(s3_url, s3_samples, ctx):
    url, opts = s3_url
    per_rank = []
    for r in range(2):
        ds = dataset(url, rank=r, world_size=2, storage_options=opts)
        next(iter(ds))  # the parent's s3fs event loop is running when the workers start
        per_rank.append(ids_of(DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context=ctx)))
    assert sorted(i for r in per_rank for i in r) == sorted(s["sample_id"] for s in s3_samples)


def test_s3_reads_only_requested_layers(s3_url, s3_samples, fetched):
    url, opts = s3_url
    by_id = {s["sample_id"]: s for s in s3_samples}
    got = list(dataset(url, layers=[3], storage_options=opts))
    assert len(got) == len(s3_samples)
    for x in got:
        assert torch.equal(bits(x["hidden_states"]), bits(by_id[x["sample_id"]]["hidden_states"][:, [1]]))
    assert set(fetched) == {"layer_003", "input_ids", "loss_mask"}
    store = hsstore.open(url, **opts)
    layer_bytes = sum(v["size"] for c in store.commits for k, v in c.files.items() if "/layer_003/c/" in k)
    assert layer_bytes <= fetched["layer_003"] <= 2 * layer_bytes


def test_s3_cache_serves_second_epoch(s3_url, s3_samples, fetched, tmp_path):
    url, opts = s3_url
    ds = dataset(url, storage_options=opts, cache_dir=str(tmp_path / "cache"))
    first = {x["sample_id"]: bits(x["hidden_states"]) for x in ds}
    assert fetched["layer_001"] > 0
    fetched.clear()
    ds.set_epoch(1)
    second = {x["sample_id"]: bits(x["hidden_states"]) for x in ds}
    assert sum(fetched.values()) == 0  # every chunk from the local cache
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    # a damaged cached copy is detected (CRC32C), dropped and fetched again
    cached = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "cache") for f in fs if "layer_005" in d]
    data = bytearray(open(cached[0], "rb").read())
    data[10] ^= 0xFF
    open(cached[0], "wb").write(bytes(data))
    ds.set_epoch(2)
    third = {x["sample_id"]: bits(x["hidden_states"]) for x in ds}
    assert all(torch.equal(first[k], third[k]) for k in first)
    assert fetched["layer_005"] > 0 and fetched["layer_001"] == 0


def test_s3_cache_capped(s3_url, s3_samples, tmp_path):
    url, opts = s3_url
    store = hsstore.open(url, **opts)
    total = sum(v["size"] for c in store.commits for k, v in c.files.items() if "/c/" in k)
    cap = total // 3
    ds = dataset(url, storage_options=opts, cache_dir=str(tmp_path / "cache"), cache_bytes=cap)
    assert len(ids_of(ds)) == len(s3_samples)
    assert 0 < ChunkCache(str(tmp_path / "cache"), cap).size() <= cap


def test_chunk_cache_lru(tmp_path):
    """Eviction drops the least recently *used* chunk, not the oldest written."""
    remote = tmp_path / "remote"
    remote.mkdir()
    import fsspec

    from hsstore.format.codec import ChunkCodec
    fs = fsspec.filesystem("file")
    blobs = {}
    for name in "abcd":
        blob = ChunkCodec("none").encode(torch.full((1000,), ord(name), dtype=torch.int16).numpy()).tobytes()
        (remote / name).write_bytes(blob)
        blobs[name] = name
    size = os.path.getsize(remote / "a") + 32  # each copy carries its 32-byte digest
    cache = ChunkCache(str(tmp_path / "cache"), max_bytes=int(size * 3.5))  # room for 3
    root = str(remote)
    cache.cat(fs, root, [blobs["a"], blobs["b"], blobs["c"]], "ns")
    assert cache.misses == 3 and cache.hits == 0
    cache.cat(fs, root, [blobs["a"]], "ns")  # a is now more recent than b
    assert cache.hits == 1
    cache.cat(fs, root, [blobs["d"]], "ns")  # over the cap: evict down to 90% -> b goes
    present = sorted(os.path.basename(p) for d, _, fs_ in os.walk(tmp_path / "cache") for p in fs_
                     if not p.startswith("."))
    assert present == ["a", "c", "d"] and cache.evicted == 1
    assert cache.size() <= cache.max_bytes
    out = cache.cat(fs, root, [blobs["b"], blobs["a"]], "ns")
    assert out[blobs["b"]] == (remote / "b").read_bytes() and cache.hits == 2


def test_chunk_cache_keeps_this_runs_copies(tmp_path):
    """With ``keep_since`` a full cache evicts only copies last used before then (another run's), never one of this
    run's: a new copy that finds no room is served but not kept, and is fetched again next time."""
    import fsspec
    import time

    from hsstore.format.codec import ChunkCodec
    remote = tmp_path / "remote"
    remote.mkdir()
    for name in "abcde":
        (remote / name).write_bytes(
            ChunkCodec("none").encode(torch.full((1000,), ord(name), dtype=torch.int16).numpy()).tobytes())
    fs, root = fsspec.filesystem("file"), str(remote)
    size = os.path.getsize(remote / "a") + 32
    ChunkCache(str(tmp_path / "cache"), int(size * 3.5)).cat(fs, root, ["a"], "ns")  # an earlier run's copy
    old = [p for d, _, fs_ in os.walk(tmp_path / "cache") for p in [os.path.join(d, f) for f in fs_] if p.endswith("a")]
    os.utime(old[0], (time.time() - 60, time.time() - 60))
    cache = ChunkCache(str(tmp_path / "cache"), int(size * 3.5), keep_since=time.time() - 1)

    def present():
        return sorted(os.path.basename(p) for d, _, fs_ in os.walk(tmp_path / "cache") for p in fs_
                      if not p.startswith("."))

    cache.cat(fs, root, ["b", "c"], "ns")
    cache.cat(fs, root, ["d"], "ns")  # full: the earlier run's copy goes
    assert present() == ["b", "c", "d"] and cache.evicted == 1
    out = cache.cat(fs, root, ["e"], "ns")  # full of this run's copies: e is served, not kept
    assert out["e"] == (remote / "e").read_bytes() and present() == ["b", "c", "d"] and cache.declined == 1
    misses = cache.misses
    cache.cat(fs, root, ["b", "e"], "ns")
    assert cache.misses == misses + 1 and present() == ["b", "c", "d"] and cache.size() <= cache.max_bytes


@pytest.mark.parametrize("stream", ["1", "0"])
def test_s3_batches_read_into_their_slots(s3_url, tmp_path, monkeypatch, stream):
    """From S3, streamed into the batch slots (or fetched as bytes and copied there, as from any filesystem but
    s3fs's), then out of the chunk cache in the second epoch: the same batches as items collated by copy."""
    url, opts = s3_url
    with contextlib.nullcontext() if stream == "1" else whole_object_fills():
        for epoch in range(2):
            def make():
                ds = dataset(url, storage_options=opts, cache_dir=str(tmp_path / "cache"), seed=1)
                ds.set_epoch(epoch)
                return hsstore.TokenBatches(ds, token_budget=300)

            assert_same_batches(*direct_and_copied(make, monkeypatch))


def test_s3_batches_refuse_a_flipped_byte(s3_store, s3_samples, tmp_path):
    """A chunk object damaged in the bucket is fetched again, then refused, before any sample it holds is handed out
    in a batch (read into its slot, checked there), through the chunk cache too; with ``skip_corrupt`` the batches
    hold every other sample, bit for bit."""
    url, opts = s3_store
    write_store(url, s3_samples[:20], shard_tokens=1000, storage_options=opts)
    store = hsstore.open(url, **opts)
    rec = store.commits[0]
    key = next(k for k in sorted(rec.files) if "layer_003/c/1/" in k)
    fs = s3fs.S3FileSystem(**opts)
    path = f"{url.replace('s3://', '')}/{key}"
    data = bytearray(fs.cat(path))
    data[100] ^= 0x20
    fs.pipe(path, bytes(data))
    bad = set()
    for i, sid in enumerate(store.sample_ids()):
        try:
            store.read(i)
        except CorruptionError:
            bad.add(sid)
    assert bad
    for cache in (None, str(tmp_path / "cache")):
        with pytest.raises(CorruptionError, match="sample '(" + "|".join(sorted(bad)) + ")'.*checksum"):
            list(hsstore.TokenBatches(dataset(url, storage_options=opts, cache_dir=cache), token_budget=300))
        got = list(hsstore.TokenBatches(dataset(url, storage_options=opts, cache_dir=cache, skip_corrupt=True),
                                        token_budget=300, mode="pack"))
        want = {s["sample_id"]: s["hidden_states"] for s in s3_samples[:20]}
        assert sorted(i for b in got for i in b["sample_id"]) == sorted(set(want) - bad)
        for b in got:
            cu = b["cu_seqlens"]
            for j, sid in enumerate(b["sample_id"]):
                assert torch.equal(bits(b["hidden_states"][int(cu[j]):int(cu[j + 1])]), bits(want[sid]))


def test_s3_store_deleted_mid_epoch(s3_store, s3_samples):
    url, opts = s3_store
    write_store(url, s3_samples[:20], shard_tokens=1000, storage_options=opts)
    ds = dataset(url, storage_options=opts, prefetch=1, shuffle_bytes=1)
    it = iter(ds)
    next(it)
    fs = s3fs.S3FileSystem(**opts)
    fs.rm(url.replace("s3://", ""), recursive=True)
    with pytest.raises(StoreError, match="disappeared mid-epoch.*manifest is gone"):
        for _ in it:
            pass


def test_fork_never_finalises_parent_filesystems():
    """A forked worker must not finalise the parent's s3fs instances (their sessions belong to the parent's
    event loop; finalising them logged from the child and once deadlocked a worker on a stderr lock)."""
    import gc
    import weakref

    fs = s3fs.S3FileSystem(endpoint_url="http://127.0.0.1:9", key="k", secret="s")  # cached by fsspec
    ref = weakref.ref(fs)
    del fs
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover  (child)
        gc.collect()
        os.write(w, b"alive" if ref() is not None else b"gone")
        os._exit(0)
    os.close(w)
    got = os.read(r, 16)
    os.waitpid(pid, 0)
    assert got == b"alive"


@pytest.mark.parametrize("cached", [False, True])
def test_s3_chunk_reads_are_one_ranged_get_each(s3_url, s3_endpoint, s3_samples, tmp_path, cached):
    """The commit record lists every chunk's size, so a read is one ranged GET per chunk, no HEAD first: half
    the requests of a first batch (issue #17's budget of requests)."""
    from hsstore.testing.faultproxy import FaultProxy

    url, _ = s3_url
    with FaultProxy(s3_endpoint, faults=[], limit=0) as proxy:
        s3fs.S3FileSystem.clear_instance_cache()
        opts = {"endpoint_url": proxy.url}
        store = hsstore.open(url, **opts)
        proxy.reset_counts()
        kw = {"cache_dir": str(tmp_path / "cache")} if cached else {}
        got = list(dataset(url, storage_options=opts, **kw))
        log = list(proxy.log)
    s3fs.S3FileSystem.clear_instance_cache()
    assert len(got) == len(s3_samples)
    chunk_reads = [(m, p) for m, p in log if "/shards/" in p and "/c/" in p]
    assert chunk_reads and not [r for r in chunk_reads if r[0] != "GET"], chunk_reads[:5]
    chunks = {k for c in store.commits for k in c.files if "/c/" in k and "/offsets/" not in k}  # what samples read
    assert len({p for _, p in chunk_reads}) == len(chunks)  # every chunk read (a chunk two groups share, twice)


def test_train_on_a_gpu_suggests_workers_for_a_remote_store_only(s3_url, s3_samples, tmp_path, caplog):
    """A remote store read in the trainer's process on a GPU: the log suggests --workers (the S3 client's Python
    off the launching thread); a local store, or workers already set, or a CPU run: nothing said."""
    import logging

    from hsstore.train.settings import TrainSettings
    from hsstore.train.trainer import store_batches

    url, opts = s3_url
    local = write_store(str(tmp_path / "local"), s3_samples[:4])
    cuda, cpu = torch.device("cuda"), torch.device("cpu")

    def said(stores, workers=0, device=cuda):
        cfg = build(TrainSettings, store=[s.url for s in stores], out="-", storage_options=opts, workers=workers,
                    token_budget=1024)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="hsstore.train.trainer"):
            try:
                store_batches(stores, [1, 3], cfg, 0, 1, device)
            except ValueError:  # --workers without torchdata: the hint comes before the loader is built
                pass
        return [r.getMessage() for r in caplog.records if "--workers 2" in r.getMessage()]

    remote, here = hsstore.Store(url, opts), hsstore.Store(local)
    assert said([remote]) == [f"reading {url} in the trainer's process: for a remote store, --workers 2 (needs "
                              "torchdata) keeps the S3 client off the thread that launches the step"]
    assert said([here, remote]) and not said([here])
    assert not said([remote], device=cpu) and not said([remote], workers=2)
    # a URL is printed as it may be written down: without the user info a user put in it
    with_user = hsstore.Store(url, opts)
    with_user.url = url.replace("s3://", "s3://someone:hunter2@", 1)  # as a user may have typed it
    assert said([with_user]) and "hunter2" not in said([with_user])[0]
