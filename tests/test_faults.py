"""S3 faults between hsstore and a real S3 endpoint (moto on loopback), injected by ``faultproxy``:
bounded faults are retried with backoff and lose or duplicate nothing; a fault that persists ends in a
clear error naming the shard and file, never in a silently short epoch. Every test asserts that its
faults were actually injected. The counts are printed (``-s``) for docs/RELIABILITY.md."""

from __future__ import annotations

import uuid

import pytest
import s3fs
import torch
from torch.utils.data import DataLoader

import hsstore
from hsstore.io import transfer
from hsstore.ops.verify import verify

from hsstore.testing.faultproxy import ALL_FAULTS, FaultProxy
from test_loader import bits, dataset, write_store
from test_loader_s3 import s3_samples, s3_url  # noqa: F401  (fixtures: one store for the read tests)

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")

FAST_FAIL = {"config_kwargs": {"retries": {"mode": "standard", "max_attempts": 2}}}  # persistent faults: fail soon


def is_chunk(path: str) -> bool:
    return "/c/" in path


@pytest.fixture(scope="module")
def fault_samples(s3_samples):
    return s3_samples


@pytest.fixture(scope="module")
def written(s3_url):
    """A store written straight to the endpoint (no faults), for the read tests."""
    return s3_url[0]


def fresh_bucket(endpoint: str) -> str:
    """A new, empty prefix for a writer test."""
    bucket = f"hs-faults-{uuid.uuid4().hex[:8]}"
    s3fs.S3FileSystem(endpoint_url=endpoint).mkdir(bucket)
    return f"s3://{bucket}/stores/w"


def assert_bit_exact(items, samples):
    by_id = {s["sample_id"]: s for s in samples}
    ids = [it["sample_id"] for it in items]
    assert sorted(ids) == sorted(by_id) and len(ids) == len(set(ids)), "lost or duplicated samples"
    for it in items:
        want = by_id[it["sample_id"]]
        assert torch.equal(it["input_ids"], want["input_ids"])
        assert torch.equal(bits(it["hidden_states"]), bits(want["hidden_states"]))


def report(name, proxy):
    print(f"\nFAULTS {name}: {dict(sorted(proxy.injected.items()))} injected in {proxy.requests} requests")


WRITE_FAULTS = ("reset", "reset_after", "500", "503", "latency")  # the writer's requests are PUTs: no body to cut


def test_writer_survives_bounded_faults(s3_endpoint, fault_samples):
    """Every kind of fault on the writer's requests (PUTs of chunks, metadata, manifest, commit records,
    also after the upstream stored the object): the store ends complete, every sample once, bit-exact, and
    verify passes."""
    s3fs.S3FileSystem.clear_instance_cache()
    url = fresh_bucket(s3_endpoint)
    with FaultProxy(s3_endpoint, faults=WRITE_FAULTS, every=3, limit=4 * len(WRITE_FAULTS), seed=1) as proxy:
        write_store(url, fault_samples, shard_tokens=600, storage_options={"endpoint_url": proxy.url})
    report("writer", proxy)
    assert proxy.injected == {k: 4 for k in WRITE_FAULTS}
    s3fs.S3FileSystem.clear_instance_cache()
    store = hsstore.open(url, endpoint_url=s3_endpoint)
    assert verify(store).ok
    assert_bit_exact([store.read(i) for i in range(len(store))], fault_samples)


@pytest.mark.parametrize("reader", ["loader", "loader_workers", "verify"])
def test_readers_survive_bounded_faults(s3_endpoint, written, fault_samples, reader):
    """Every kind of fault on the reads of the loader (commit records, chunks) or of verify, including bodies
    cut short of their Content-Length and silently short chunk bodies that only the CRC32C catches: the epoch
    holds every sample once, bit-exact; verify passes."""
    s3fs.S3FileSystem.clear_instance_cache()
    with FaultProxy(s3_endpoint, every=3, limit=2 * len(ALL_FAULTS), seed=2, short_on=is_chunk) as proxy:
        opts = {"endpoint_url": proxy.url}
        if reader.startswith("loader"):
            ds = dataset(written, storage_options=opts, prefetch=2, shuffle_bytes=1 << 16)
            if reader == "loader_workers":  # forked DataLoader workers, each with its own s3fs client
                ds = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork")
            assert_bit_exact(list(ds), fault_samples)
        else:
            rep = verify(hsstore.open(written, **opts))
            assert rep.ok, [str(p) for p in rep.problems]
    report(reader, proxy)
    assert proxy.injected == {k: 2 for k in ALL_FAULTS}


def test_short_body_fetched_again_then_called_corrupt(s3_endpoint, written):
    """A chunk whose body is always cut (Content-Length matching) is fetched FETCH_ATTEMPTS times, then the
    read raises CorruptionError naming shard and file -- a bounded re-fetch, not an endless one."""
    s3fs.S3FileSystem.clear_instance_cache()
    direct = hsstore.open(written, endpoint_url=s3_endpoint)
    victim = f"shards/{direct.commits[0].shard}/layer_003/c/0/0"
    with FaultProxy(s3_endpoint, faults=["short"], persistent=True, match=lambda m, p: p.endswith(victim)) as proxy:
        store = hsstore.open(written, endpoint_url=proxy.url)
        with pytest.raises(hsstore.CorruptionError,
                           match=rf"{direct.commits[0].shard}.*{victim}.*(checksum|ended early)"):
            store.read(0)
    report("short persistent", proxy)
    assert proxy.injected["short"] == transfer.FETCH_ATTEMPTS


@pytest.mark.parametrize("kind", ["reset", "503"])
def test_persistent_fault_loader_raises_never_skips(s3_endpoint, written, kind):
    """Chunk reads that always fail: the loader raises FetchError naming store, shard and file -- also with
    skip_corrupt=True, which skips corrupt bytes only: an unreachable store never shortens an epoch."""
    s3fs.S3FileSystem.clear_instance_cache()
    with FaultProxy(s3_endpoint, faults=[kind], persistent=True, match=lambda m, p: is_chunk(p)) as proxy:
        ds = dataset(written, storage_options={"endpoint_url": proxy.url, **FAST_FAIL}, skip_corrupt=True)
        with pytest.raises(hsstore.FetchError, match=rf"shard '.+' of store '{written}', file shards/.+/c/"
                                                     r".*read failed after retries"):
            list(ds)
    report(f"loader persistent {kind}", proxy)
    assert proxy.injected[kind] > 0


@pytest.mark.parametrize("kind", ["reset", "500"])
def test_persistent_fault_writer_raises_commits_nothing(s3_endpoint, fault_samples, kind):
    """Chunk uploads that always fail: the writer raises naming the shard; no commit record is written."""
    s3fs.S3FileSystem.clear_instance_cache()
    url = fresh_bucket(s3_endpoint)
    chunk_puts = lambda m, p: m == "PUT" and is_chunk(p)  # noqa: E731
    with FaultProxy(s3_endpoint, faults=[kind], persistent=True, match=chunk_puts) as proxy:
        opts = {"endpoint_url": proxy.url, **FAST_FAIL}
        with pytest.raises(hsstore.StoreError, match=rf"writing shard '.+' of store '{url}' failed"):
            write_store(url, fault_samples, shard_tokens=600, storage_options=opts)
    report(f"writer persistent {kind}", proxy)
    assert proxy.injected[kind] > 0
    s3fs.S3FileSystem.clear_instance_cache()
    assert len(hsstore.open(url, endpoint_url=s3_endpoint)) == 0


@pytest.mark.parametrize("reader", ["loader", "read"])
def test_wds_readers_survive_bounded_faults(s3_endpoint, fault_samples, reader):
    """The same faults on a wds store's byte-range reads of its tars: a range cut short (by the body or with
    a matching Content-Length) is fetched again; every sample arrives once, bit-exact. (``read``: plain
    ``Store.read``, which has no per-sample re-read to fall back on, unlike the loader.)"""
    import dataclasses

    from conftest import make_manifest

    s3fs.S3FileSystem.clear_instance_cache()
    url = fresh_bucket(s3_endpoint)
    write_store(url, fault_samples, manifest=dataclasses.replace(make_manifest(chunk_tokens=64), layout="wds"),
                shard_tokens=600, storage_options={"endpoint_url": s3_endpoint})
    s3fs.S3FileSystem.clear_instance_cache()
    with FaultProxy(s3_endpoint, every=2, limit=2 * len(ALL_FAULTS), seed=3,  # wds: few, merged range reads
                    short_on=lambda p: p.endswith(".tar")) as proxy:
        opts = {"endpoint_url": proxy.url}
        if reader == "loader":
            items = list(dataset(url, storage_options=opts, prefetch=2, shuffle_bytes=1 << 16))
        else:
            store = hsstore.open(url, **opts)
            items = [store.read(i) for i in range(len(store))]
        assert_bit_exact(items, fault_samples)
    report(f"wds {reader}", proxy)
    assert proxy.injected == {k: 2 for k in ALL_FAULTS}


def test_wds_persistent_fault_raises_never_skips(s3_endpoint, fault_samples):
    """Tar range reads that always fail: FetchError naming store, shard and file, even with skip_corrupt."""
    import dataclasses

    from conftest import make_manifest

    s3fs.S3FileSystem.clear_instance_cache()
    url = fresh_bucket(s3_endpoint)
    write_store(url, fault_samples[:6], manifest=dataclasses.replace(make_manifest(chunk_tokens=64), layout="wds"),
                storage_options={"endpoint_url": s3_endpoint})
    s3fs.S3FileSystem.clear_instance_cache()
    with FaultProxy(s3_endpoint, faults=["503"], persistent=True, match=lambda m, p: p.endswith(".tar")) as proxy:
        ds = dataset(url, storage_options={"endpoint_url": proxy.url, **FAST_FAIL}, skip_corrupt=True)
        with pytest.raises(hsstore.FetchError, match=rf"shard '.+' of store '{url}'.*read failed"):
            list(ds)
    report("wds loader persistent 503", proxy)
    assert proxy.injected["503"] > 0


def test_proxy_drops_object_checksums_from_ranged_answers_as_aws_does(s3_endpoint):
    """The S3 emulation of the benches (``range_checksums=False``) answers a Range request without the object's
    checksum headers, as AWS S3 does for any range (MinIO since PR 17105 too), while moto sends them for a range
    that covers the whole object; a plain GET keeps them, and the bytes are the same either way."""
    import boto3

    bucket = fresh_bucket(s3_endpoint).split("/")[2]
    body = bytes(range(256)) * 40
    boto3.client("s3", endpoint_url=s3_endpoint).put_object(Bucket=bucket, Key="k", Body=body)

    def checksum_headers(proxy, rng):
        c = boto3.client("s3", endpoint_url=proxy.url)
        r = c.get_object(Bucket=bucket, Key="k", ChecksumMode="ENABLED", **({"Range": rng} if rng else {}))
        assert r["Body"].read() == body
        return {k for k in r["ResponseMetadata"]["HTTPHeaders"] if k.startswith("x-amz-checksum-")}

    whole = f"bytes=0-{len(body) - 1}"
    with FaultProxy(s3_endpoint, faults=[], limit=0) as moto_like:
        assert checksum_headers(moto_like, whole), "moto no longer sends checksums for a whole-object range"
    with FaultProxy(s3_endpoint, faults=[], limit=0, range_checksums=False) as aws_like:
        assert checksum_headers(aws_like, whole) == set()
        assert checksum_headers(aws_like, None), "a plain GET keeps the object's checksum"
