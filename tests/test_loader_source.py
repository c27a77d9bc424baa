"""Throughput at the source (issue #28): the remote read-ahead sized from bandwidth x latency, and
``hsstore bench --what source`` (N ranks at once, local cold or an S3 endpoint behind the delaying proxy)."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import s3fs

from hsstore.loader.dataset import HiddenStateDataset, read_ahead_units

from conftest import make_samples
from test_loader import dataset, ids_of, write_store

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")


def test_read_ahead_units_is_littles_law():
    # 2.5 GB/s of 16 MB requests that take 0.19 s (30 ms + 16 MB at 100 MB/s): 30 requests in flight, 20 a unit
    assert read_ahead_units(2.5e9, 0.19, 16e6, 20, 64, 1, 64) == 3
    # latency alone needs more in flight the longer it is; never beyond what the connections carry, nor the cap
    a, b = read_ahead_units(1e9, 0.01, 1e6, 4, 64, 1, 64), read_ahead_units(1e9, 0.03, 1e6, 4, 64, 1, 64)
    assert a == 4 and b == 9
    assert read_ahead_units(1e9, 10.0, 1e6, 4, 64, 1, 64) == 18  # (64 + 4) / 4 + 1: the connections' limit
    assert read_ahead_units(1e9, 10.0, 1e6, 4, 64, 1, 6) == 6
    assert read_ahead_units(1e9, 0.0, 1e6, 4, 64, 2, 64) == 2  # the floor (prefetch)


def test_remote_read_ahead_grows_with_latency(s3_endpoint, tmp_path):
    """Behind a 50 ms proxy every request takes >= 50 ms, so the read-ahead must grow past ``prefetch`` to keep
    the rate; the order and the items are those of a fixed read-ahead."""
    from hsstore.testing.faultproxy import FaultProxy

    s3fs.S3FileSystem.clear_instance_cache()
    bucket = f"hs-ra-{uuid.uuid4().hex[:8]}"
    s3fs.S3FileSystem(endpoint_url=s3_endpoint).mkdir(bucket)
    url = f"s3://{bucket}/stores/a"
    write_store(url, make_samples(24, max_len=120), shard_tokens=1000, storage_options={"endpoint_url": s3_endpoint})
    with FaultProxy(s3_endpoint, faults=[], limit=0, latency=0.05) as proxy:
        s3fs.S3FileSystem.clear_instance_cache()
        opts = {"endpoint_url": proxy.url}
        ds = dataset(url, storage_options=opts, prefetch=2)
        it = iter(ds)
        got = [next(it)["sample_id"] for _ in range(4)]
        depth = it.depth
        got += ids_of(it)
        fixed = ids_of(dataset(url, storage_options=opts, prefetch=2, remote_rate=0))
    s3fs.S3FileSystem.clear_instance_cache()
    # request bytes: 64 tokens x 96 B; 2 chunks x 3 layers a unit; >= 0.05 s each -> the connections' limit
    assert depth == read_ahead_units(2.5e9, 0.05, 64 * 96, 6, 64, 2, ds.max_prefetch) > 2
    assert got == fixed


def test_run_buffers_are_recycled_across_epochs(tmp_path):
    """Local reads land in the dataset's buffer pool, reused once a run's items are dropped: fresh memory
    faults in page by page, which cost as much as the read (the pool was bypassed from #28's read-ahead change
    on: 2.8x the GB/s and 0.34x the CPU-s/GB with it, one thread, alternated in one run)."""
    url = write_store(str(tmp_path / "s"), make_samples(30, min_len=40, max_len=120))
    ds = HiddenStateDataset(url)  # default pool size (the tests' small one holds no 16 MiB buffer)
    per_epoch = []
    for epoch in range(3):
        ds.set_epoch(epoch)
        per_epoch.append(sorted(ids_of(ds)))  # items dropped as they come, as a training step drops its batch
    pool = ds._pool()
    assert pool is not None and pool.allocated > 0
    assert pool.reused > 0  # later runs took buffers the earlier ones had released
    assert per_epoch[0] == per_epoch[1] == per_epoch[2] and len(per_epoch[0]) == 30


@pytest.mark.slow
@pytest.mark.parametrize("batches", [[], ["--batch-tokens", "700"]])
def test_source_bench_feeds_ranks_at_once(tmp_path, capsys, batches):
    """Items, or the trainer's padded batches (each rank's bytes: its samples' features, not the padding)."""
    from hsstore.app.cli import main

    assert main(["bench", str(tmp_path), "--what", "source", "--procs", "2", "--size-mb", "2", "--hidden", "64",
                 "--num-taps", "2", "--epochs", "2", "--cold", "--prefetch", "1", "--json", "--quiet", *batches]) == 0
    import json

    r = json.loads(capsys.readouterr().out)["source"]
    assert r["procs"] == 2 and r["prefetch"] == 1 and [e["epoch"] for e in r["epochs"]] == [0, 1]
    assert r["token_budget"] == (700 if batches else 0)
    for e in r["epochs"]:
        assert e["bytes"] == r["bytes"] > 0 and len(e["per_rank_gbps"]) == 2 and e["cpu_s_per_gb"] > 0
        # the raw baseline: the store's files (features, ids, masks, metadata) by as many plain readers
        raw = e["raw"]
        assert set(raw) == {"read", "mmap", "kept", "checked"}
        assert len({x["bytes"] for x in raw.values()}) == 1 and raw["read"]["bytes"] > e["bytes"]
        assert raw["read"]["bytes"] == r["stored_bytes"]  # every object the records list, edge chunks full-size
        assert all(len(x["per_rank_gbps"]) == 2 for x in raw.values())
        assert e["vs_raw"]["read"]["total"] == pytest.approx(e["total_gbps"] / raw["read"]["total_gbps"])
    assert list(tmp_path.iterdir()) == []  # the scratch store is removed


@pytest.mark.parametrize("check", [False, True])
def test_kept_raw_reads_land_in_the_destination_and_wrap(tmp_path, check):
    """The kept baseline really reads each file into the next bytes of its destination (from the start again
    when a file does not fit; a file larger than it in pieces): it times reads, not skipped work."""
    from hsstore.ops.bench import _read_kept

    rng = np.random.default_rng(0)
    data = {n: rng.integers(0, 256, n, dtype=np.uint8) for n in (300, 500, 1500)}
    dest = np.zeros(600, np.uint8)
    pos = 0
    for n, want in data.items():
        with open(tmp_path / f"f{n}", "wb") as f:
            f.write(want.tobytes())
        with open(tmp_path / f"f{n}", "rb", buffering=0) as f:
            pos = _read_kept(f.fileno(), n, dest, pos, check)
        if n == 300:
            assert pos == 300 and np.array_equal(dest[:300], want)
        elif n == 500:  # 300 + 500 > 600: from the start
            assert pos == 500 and np.array_equal(dest[:500], want)
        else:  # 600, 600, then the last 300 at the start
            assert pos == 300 and np.array_equal(dest[:300], want[1200:]) and np.array_equal(dest[300:], want[900:1200])
