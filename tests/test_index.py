"""The store's index (docs/FORMAT.md, "Index"): opening reads a listing and a few segments instead of one commit
record per shard; shards committed after the index, rewritten records, records gone and damaged segments are
handled from the listing; ``verify`` checks the index against the records; per-shard reads run concurrently;
under torch.distributed one rank reads the metadata for the job. Request counts come from the fault proxy
(tests/faultproxy.py) in front of moto's S3 server."""

from __future__ import annotations

import gzip
import json
import logging
import os
import dataclasses
import struct
import datetime

import fsspec
import pytest
import torch

import hsstore
from hsstore import env
from hsstore.format import codec, commit, index, records
from hsstore.io import listing, storage, transfer
from hsstore.app.cli import main
from hsstore.ops.convert import convert
from hsstore.ops.merge import merge
from hsstore.ops.subset import SampleFilter, subset
from hsstore.ops.verify import verify

from conftest import PATIENT_S3, make_manifest, make_samples, write_samples
from hsstore.testing.faultproxy import FaultProxy
from hsstore.testing.hostile_http import HostileHTTPServer

N_SHARDS = 12


def _write(url, opts=None, n=N_SHARDS, prefix="s", **kw):
    """``n`` shards of one sample each (tiny features): a metadata-heavy store."""
    write_samples(url, make_manifest(hidden=16), make_samples(n, hidden=16, max_len=20, prefix=prefix),
                  shard_bytes=1, storage_options=opts, **kw)


def _record_gets(proxy) -> list[str]:
    return [p for m, p in proxy.log if m == "GET" and "/commits/" in p and ".json" in p.split("?")[0]]


def _local_fs():
    return fsspec.filesystem("file")


def _segments(root) -> list[str]:
    return sorted(os.listdir(os.path.join(root, index.INDEX_DIR)))


# -- S3: requests --------------------------------------------------------------------------------------------
def test_open_on_s3_reads_the_index_not_one_record_per_shard(s3_store, s3_endpoint):
    url, opts = s3_store
    _write(url, opts)
    with FaultProxy(s3_endpoint, faults=["latency"], persistent=True, delay=0.0) as proxy:
        popts = {"endpoint_url": proxy.url}
        store = hsstore.open(url, **popts)
        assert len(store.commits) == N_SHARDS and store.index_use.indexed == N_SHARDS
        assert _record_gets(proxy) == []  # every record came from the writer's segment
        assert proxy.requests <= 6, proxy.log  # manifest, LIST commits/, LIST index/, the segment
        proxy.reset_counts()
        direct = hsstore.store.reader.Store(url, popts, use_index=False)
        assert len(_record_gets(proxy)) == N_SHARDS  # what every open cost before the index
        assert [c.shard for c in direct.commits] == [c.shard for c in store.commits]
        assert direct.commits == store.commits
        # another writer (another client: this process's listing cache of commits/ knows nothing of it) adds two
        _write(url, opts, n=2, prefix="late")
        again = hsstore.open(url, **popts)
        assert len(again.commits) == N_SHARDS + 2 and again.index_use.indexed == N_SHARDS + 2


def test_records_are_read_concurrently_and_the_concurrency_is_configurable(s3_store, s3_endpoint, monkeypatch):
    import s3fs

    url, opts = s3_store
    _write(url, opts, n=40)
    is_record = lambda m, p: m == "GET" and "/commits/" in p  # noqa: E731
    for limit, check in ((None, lambda n: n >= 16), ("4", lambda n: n <= 4)):
        if limit:
            monkeypatch.setenv(env.METADATA_CONCURRENCY.name, limit)
        s3fs.S3FileSystem.clear_instance_cache()
        with FaultProxy(s3_endpoint, faults=["latency"], persistent=True, delay=0.05, match=is_record) as proxy:
            hsstore.store.reader.Store(url, {"endpoint_url": proxy.url}, use_index=False)
            assert len(_record_gets(proxy)) == 40
            # botocore's default pool of 10 connections kept it at <= 10 before; 64 in flight by default now
            assert check(proxy.max_in_flight), (limit, proxy.max_in_flight)
    monkeypatch.setenv(env.METADATA_CONCURRENCY.name, "0")
    with pytest.raises(hsstore.StoreError, match=env.METADATA_CONCURRENCY.name):
        storage.metadata_concurrency()


def test_a_record_rewritten_on_s3_is_read_again_not_taken_from_the_index(s3_store, s3_endpoint):
    url, opts = s3_store
    _write(url, opts)
    fs, root = storage.resolve(url, opts)
    first = hsstore.open(url, **opts).commits[3]
    stamp = "2099" + first.created_at[4:]
    new = dataclasses.replace(first, created_at=stamp)  # same size, new content: a new ETag
    assert len(new.to_json()) == len(first.to_json())
    commit.publish(fs, root, new)
    fs.invalidate_cache()
    with FaultProxy(s3_endpoint, faults=["latency"], persistent=True, delay=0.0) as proxy:
        store = hsstore.open(url, endpoint_url=proxy.url)
    assert store.record(first.shard).created_at == stamp
    assert store.index_use.stale == [first.shard] and store.index_use.fetched == 1
    assert len(_record_gets(proxy)) == 1


# -- correctness: late shards, stale, orphan, damaged --------------------------------------------------------
def test_shards_committed_after_the_index_are_found_and_orphan_entries_ignored(tmp_path, capsys):
    url = str(tmp_path / "s")
    _write(url)
    assert main(["index", url, "--grace", "0"]) == 0
    assert len(_segments(url)) == 1 and _segments(url)[0].startswith("c-")
    gone = commit.list_committed(_local_fs(), url)[0] + ".json"  # indexed
    # a writer killed before it wrote its segment: its shards are committed, the index knows nothing of them
    _write(url, n=5, prefix="late", index_every=10**6)
    late = [s for s in _segments(url) if s.startswith("w-")]
    os.remove(os.path.join(url, index.INDEX_DIR, late[0]))
    os.remove(os.path.join(url, commit.COMMITS_DIR, gone))  # an entry whose record is not listed
    store = hsstore.open(url)
    assert len(store.commits) == N_SHARDS + 5 - 1
    assert gone[: -len(".json")] not in {c.shard for c in store.commits}  # never invented from the index
    assert store.index_use.fetched == 5 and store.index_use.indexed == N_SHARDS - 1
    assert sum(1 for sid in store.sample_ids() if sid.startswith("late")) == 5
    report = verify(store)
    assert report.index["unindexed_shards"] == 5 and report.index["orphan_entries"] == 1
    capsys.readouterr()
    assert main(["info", url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["index"] == {"indexed": N_SHARDS - 1, "fetched": 5, "segments": 1,
                                                            "damaged": 0}
    # compaction takes the late records in
    assert main(["index", url, "--grace", "0"]) == 0
    again = hsstore.open(url)
    assert again.index_use.fetched == 0 and again.commits == store.commits


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_damaged_segment_is_ignored_with_a_warning_and_hides_no_shard(tmp_path, caplog, damage):
    url = str(tmp_path / "s")
    _write(url)
    path = os.path.join(url, index.INDEX_DIR, _segments(url)[0])
    data = bytearray(open(path, "rb").read())
    if damage == "truncate":  # a writer killed mid-write on a filesystem without atomic rename
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0x40
    open(path, "wb").write(bytes(data))
    with caplog.at_level(logging.WARNING, logger="hsstore.format.index"):
        store = hsstore.open(url)
    assert len(store.commits) == N_SHARDS and store.index_use.fetched == N_SHARDS
    assert store.index_use.damaged == [os.path.basename(path)]
    assert "index segment" in caplog.text and "ignored" in caplog.text
    report = verify(store)
    assert not report.ok and any(p.shard == "(index)" for p in report.problems)
    assert main(["index", url, "--grace", "0"]) == 0  # rewritten (the damaged one superseded and removed)
    assert verify(hsstore.open(url)).ok


def _v1_segment(path_records: list[tuple[bytes, str | None]]) -> bytes:
    """A version-1 segment as docs/FORMAT.md specifies it (gzip'd JSON, whole records in entries)."""
    entries = [{"shard": json.loads(d)["shard"], "size": len(d), "stamp": st, "crc32c": codec.crc32c(d),
                "record": json.loads(d)} for d, st in path_records]
    body = {"format": "hsstore-index", "version": 1, "kind": "compacted", "created_at": "2024-01-01T00:00:00Z",
            "created_unix": 0.0, "writer": "old hsstore", "supersedes": {}, "entries": entries}
    return gzip.compress(json.dumps(body).encode())


def _listed_records(url) -> list[tuple[bytes, str | None]]:
    listed = index.listed_records(_local_fs(), url)
    return [(open(os.path.join(url, commit.commit_path(n)), "rb").read(), listed[n].stamp) for n in sorted(listed)]


@pytest.mark.parametrize("forge", ["v2-record", "v2-columns", "v1-record"])
def test_verify_names_an_entry_that_differs_from_its_record(tmp_path, capsys, forge):
    url = str(tmp_path / "s")
    _write(url)
    assert verify(hsstore.open(url)).ok
    (name,) = _segments(url)
    path = os.path.join(url, index.INDEX_DIR, name)
    items = _listed_records(url)
    victim = json.loads(items[2][0])["shard"]
    if forge == "v1-record":
        os.remove(path)
        d = json.loads(items[2][0])
        d["samples"]["source"] = ["forged"]
        forged = _v1_segment(items)
        body = json.loads(gzip.decompress(forged))
        body["entries"][2]["record"] = d  # size, stamp, crc still those of the record
        path = os.path.join(url, index.INDEX_DIR, "c-old.json.gz")
        open(path, "wb").write(gzip.compress(json.dumps(body).encode()))
    elif forge == "v2-record":  # the record's bytes in the segment changed, its columns not
        seg = index.decode_segment(name, open(path, "rb").read())
        t = seg.table
        row = t.shard.tolist().index(victim)
        raws = [t.raw(i) for i in range(len(t))]
        raws[row] = raws[row].replace(b'"writer":"', b'"writer":"X')
        parsed = [(commit.CommitRecord.from_json(r, "x"), r, t.stamp[i], int(t.crc32c[i]), int(t.size[i]))
                  for i, r in enumerate(raws)]
        forged = records.from_records(parsed)
        forged.writer = t.writer  # columns as they were
        open(path, "wb").write(index.encode_segment("writer", "w", forged))
        assert hsstore.open(url).index_use.indexed == N_SHARDS  # readers would use it
    else:  # the columns say another thing than the record (what opening, info and the loader read)
        seg = index.decode_segment(name, open(path, "rb").read())
        t = seg.table
        row = t.shard.tolist().index(victim)
        loss = t.samples["loss_tokens"].copy()
        loss[t.first[row]] += 1
        t.samples["loss_tokens"] = loss
        open(path, "wb").write(index.encode_segment("writer", "w", t))
    store = hsstore.open(url)
    report = verify(store)
    assert [p.shard for p in report.problems] == [victim]
    assert "index entry differs" in report.problems[0].message
    assert main(["verify", url, "-q"]) == 1
    assert f"shard {victim}" in capsys.readouterr().out


def test_compaction_keeps_a_writer_segment_that_grew_after_it_and_removes_only_after_the_grace(tmp_path):
    url = str(tmp_path / "s")
    _write(url)
    fs = _local_fs()
    (writer_segment,) = _segments(url)
    r = index.compact(fs, url, grace_s=3600)
    assert r.superseded == 1 and r.removed == []  # a reader that listed the old segment may still read it
    assert _segments(url) == sorted([writer_segment, r.segment])
    store = hsstore.open(url)
    assert store.index_use.segments == 1 and store.index_use.superseded == 1 and store.index_use.fetched == 0
    # the writer's session rewrote its segment since (it grew): superseded was the older version only
    path = os.path.join(url, index.INDEX_DIR, writer_segment)
    os.utime(path, (os.stat(path).st_atime, os.stat(path).st_mtime + 5))
    assert hsstore.open(url).index_use.segments == 2
    r2 = index.compact(fs, url, grace_s=0)
    assert sorted(r2.removed) == sorted([writer_segment, r.segment])
    assert _segments(url) == [r2.segment]


# -- the commands that write records keep the index current ----------------------------------------------------
def test_merge_by_reference_convert_and_subset_index_what_they_write(tmp_path, monkeypatch):
    monkeypatch.setenv("HSSTORE_ALLOW_LOCATIONS", str(tmp_path))  # ref's shards are read from src
    src = str(tmp_path / "src")
    _write(src)
    ref, conv, sub = (str(tmp_path / n) for n in ("ref", "conv", "sub"))
    merge(ref, [src], by="reference", progress=False)

    convert(src, conv, "wds")
    subset(src, sub, SampleFilter(min_length=1), progress=False)
    for url in (ref, conv, sub):
        store = hsstore.open(url)
        assert len(store) == N_SHARDS
        assert store.index_use.fetched == 0 and store.index_use.indexed == len(store.commits), url
        assert verify(store).ok, url


# -- one open per job ------------------------------------------------------------------------------------------
def _rank_main(rank, world, init, url, endpoint, out):
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    ds = hsstore.HiddenStateDataset(url, storage_options={"endpoint_url": endpoint, **PATIENT_S3},
                                    share_metadata=True,
                                    planning=hsstore.Planning(shuffle_bytes=1 << 12))
    items = list(DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="spawn"))
    with open(f"{out}.{rank}", "w") as f:
        json.dump(sorted(x["sample_id"] for x in items), f)
    dist.barrier()
    dist.destroy_process_group()


def test_two_ranks_with_two_workers_read_the_metadata_once(s3_store, s3_endpoint, tmp_path):
    url, opts = s3_store
    _write(url, opts)
    fs, root = storage.resolve(url, opts)
    fs.rm(storage.join(root, index.INDEX_DIR), recursive=True)  # one GET per record: count them
    with FaultProxy(s3_endpoint, faults=["latency"], persistent=True, delay=0.0) as proxy:
        torch.multiprocessing.spawn(_rank_main, args=(2, f"file://{tmp_path / 'pg'}", url, proxy.url,
                                                      str(tmp_path / "ids")), nprocs=2, join=True)
    ids = [json.load(open(tmp_path / f"ids.{r}")) for r in range(2)]
    assert sorted(ids[0] + ids[1]) == sorted(f"s{i}" for i in range(N_SHARDS))  # every sample once
    assert len(_record_gets(proxy)) == N_SHARDS  # not 2 ranks x (1 + 2 workers) times
    assert sum(1 for m, p in proxy.log if m == "GET" and p.split("?")[0].endswith("/manifest.json")) == 1


def test_upgrade_leaves_the_index_current(tmp_path):
    from test_integrity import downgrade

    from hsstore.ops.upgrade import upgrade

    url = str(tmp_path / "s")
    _write(url)
    downgrade(url)  # records of format version 1, rewritten in place: the writer's entries are stale now
    old = hsstore.open(url)
    assert old.index_use.fetched == N_SHARDS and all(not c.binds_chunks for c in old.commits)
    index.compact(_local_fs(), url, grace_s=0)  # the version-1 records, indexed
    assert hsstore.open(url).index_use.fetched == 0
    assert upgrade(hsstore.open(url)).rewritten == N_SHARDS
    new = hsstore.open(url)  # the compacted entries are outdated, upgrade's own segment holds the new records
    assert all(c.binds_chunks for c in new.commits)
    assert new.index_use.fetched == 0 and len(new.index_use.stale) == 0 and new.index_use.segments == 2
    assert verify(new).ok


KILLED_WRITER = """
import sys, time
from conftest import make_manifest, make_samples
from hsstore import StoreWriter
url = sys.argv[1]
with StoreWriter(url, make_manifest(hidden=16), shard_bytes=1, index_every=1, writer_tag="w") as w:
    for s in make_samples(400, hidden=16, max_len=20):
        w.add(s["sample_id"], s["input_ids"], s["loss_mask"], s["hidden_states"])
"""


@pytest.mark.parametrize("after", [3, 9, 17])
def test_kill_9_of_a_writer_rewriting_its_segment_hides_and_invents_nothing(tmp_path, after):
    """A writer that rewrites its index segment after every commit is killed (SIGKILL) at a seeded point: the
    store opened through the index holds exactly the shards whose commit records exist, verify passes, and a
    second writer finishes the job."""
    import signal
    import subprocess
    import sys
    import time

    url = str(tmp_path / "store")
    script = tmp_path / "writer.py"
    script.write_text(KILLED_WRITER)
    env = {**os.environ, "PYTHONPATH": os.path.dirname(__file__)}
    proc = subprocess.Popen([sys.executable, str(script), url], env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if len(commit.list_committed(_local_fs(), url)) >= after:
            break
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read()[-2000:]
    listed = set(commit.list_committed(_local_fs(), url))
    assert after <= len(listed) < 400 and _segments(url)  # killed mid-run, with a segment written
    with_index, without = hsstore.open(url), hsstore.Store(url, {}, use_index=False)
    assert {c.shard for c in with_index.commits} == listed == {c.shard for c in without.commits}
    assert with_index.sample_ids() == without.sample_ids()
    assert verify(with_index).ok
    done = set(with_index.sample_ids())
    rest = [s for s in make_samples(400, hidden=16, max_len=20) if s["sample_id"] not in done]
    write_samples(url, make_manifest(hidden=16), rest, shard_bytes=1, writer_tag="w2")
    again = hsstore.open(url)
    assert sorted(again.sample_ids()) == sorted(f"s{i}" for i in range(400)) and verify(again).ok


# -- segment version 2: columns, lazily parsed records, version 1 still read -----------------------------------
def test_open_info_and_the_catalog_parse_no_record_and_a_record_parsed_later_is_the_committed_one(tmp_path):
    from hsstore.ops.info import summarize

    url = str(tmp_path / "s")
    _write(url)
    store = hsstore.open(url)
    assert store.index_use.indexed == N_SHARDS
    summary = summarize(store)
    ds = hsstore.HiddenStateDataset(store, planning=hsstore.Planning(shuffle=False))
    assert len(ds.catalog) == N_SHARDS
    assert len(store.commits._parsed) == 0  # opening, info and the loader's catalog read the columns only
    direct = hsstore.Store(url, {}, use_index=False)  # every record read from commits/
    assert {**summarize(direct), "index": None} == {**summary, "index": None}
    for i, name in enumerate(commit.list_committed(_local_fs(), url)):
        data = open(os.path.join(url, commit.commit_path(name)), "rb").read()
        assert store.table.raw(i) == data  # the record's own bytes, not a re-encoding
        rec = store.commits[i]
        assert rec.to_json() == data and rec == commit.CommitRecord.from_json(data, "x")
        assert store.table.row_of(i) == records.record_row(rec, data, codec.crc32c(data))
        assert store.ref(int(store._first[i])).sample_id == rec.samples["sample_id"][0]
    assert store.sample_ids() == direct.sample_ids()


def test_a_version_1_segment_is_still_read(tmp_path):
    url = str(tmp_path / "s")
    _write(url, index_every=10**6)
    for name in _segments(url):
        os.remove(os.path.join(url, index.INDEX_DIR, name))
    items = _listed_records(url)
    open(os.path.join(url, index.INDEX_DIR, "c-20240101T000000Z-index-00000000.json.gz"), "wb").write(
        _v1_segment(items))
    store = hsstore.open(url)
    assert store.index_use.indexed == N_SHARDS and store.index_use.fetched == 0 and store.index_use.damaged == []
    direct = hsstore.Store(url, {}, use_index=False)
    assert store.commits == direct.commits and store.sample_ids() == direct.sample_ids()
    assert verify(store).ok
    r = index.compact(_local_fs(), url, grace_s=0)  # rewritten as version 2, the version-1 one removed
    assert _segments(url) == [r.segment] and r.segment.endswith(index.SEGMENT_SUFFIX)
    assert open(os.path.join(url, index.INDEX_DIR, r.segment), "rb").read(len(index.MAGIC)) == index.MAGIC
    again = hsstore.open(url)
    assert again.index_use.indexed == N_SHARDS and again.commits == direct.commits and verify(again).ok


@pytest.mark.parametrize("cut", [1, 4, 100])
def test_a_version_2_segment_cut_anywhere_is_detected(tmp_path, cut):
    url = str(tmp_path / "s")
    _write(url)
    (name,) = _segments(url)
    data = open(os.path.join(url, index.INDEX_DIR, name), "rb").read()
    assert sorted(index.decode_segment(name, data).table.shard.tolist()) == commit.list_committed(_local_fs(), url)
    for bad in (data[:-cut], data[:len(data) // 2 + cut], data + b"\0" * cut):
        with pytest.raises(hsstore.errors.CorruptionError, match="index segment"):
            index.decode_segment(name, bad)
    future = bytearray(data)
    future[len(index.MAGIC) + 4:] = data[len(index.MAGIC) + 4:].replace(b'"version":2', b'"version":9', 1)
    future[-4:] = codec.crc32c(bytes(future[:-4])).to_bytes(4, "little")
    with pytest.raises(hsstore.errors.CorruptionError, match="version 9"):
        index.decode_segment(name, bytes(future))


# -- listing commits/ in concurrent ranges ----------------------------------------------------------------------
def _keys(fs, root, names):
    transfer.put_many(fs, {storage.join(root, "commits", n): b"x" * (len(n) % 7) for n in names})


def test_split_listing_equals_the_serial_listing(s3_store):
    url, opts = s3_store
    fs, root = storage.resolve(url, opts)
    names = [f"k{i:05d}.json" for i in range(0, 2400, 2)]  # 1,200 keys: one range spans more than a page
    _keys(fs, root, names + ["a.tmp", "zz"])
    path = storage.join(root, "commits")
    serial = listing.list_detail(fs, path)
    splits_cases = [
        ["k00010.json", "k00020.json", "k01999.json"],  # exactly at keys; one range (k00020, k01999] > 1,000 keys
        ["k00011.json", "k00011x.json", "k00012.json"],  # between keys; an empty range
        ["a", "k99999.json", "zzz"],  # before every key, after every key
    ]
    for splits in splits_cases:
        got = listing.list_detail_split(fs, path, splits)
        assert list(sorted(got)) == sorted(serial)
        assert {k: (v["size"], listing.stamp(v)) for k, v in got.items()} == \
               {k: (v["size"], listing.stamp(v)) for k, v in serial.items()}
    # keys added after the split points were chosen (shards committed after the index): found
    _keys(fs, root, ["k00011.json", "k00010a.json", "k01999z.json", "k00000.json"])
    got = listing.list_detail_split(fs, path, splits_cases[0] + splits_cases[1])
    assert sorted(got) == sorted(listing.list_detail(fs, path))
    assert listing.list_detail_split(fs, storage.join(root, "nothing"), ["k"]) == {}
    # the split listing parses timestamps as text on a session of its own: the store's filesystem keeps datetimes
    assert isinstance(fs.ls(path, detail=True, refresh=True)[0]["LastModified"], datetime.datetime)


def test_open_on_s3_lists_ranges_concurrently_and_finds_late_shards(s3_store, s3_endpoint, monkeypatch):
    url, opts = s3_store
    _write(url, opts, n=30)
    fs, root = storage.resolve(url, opts)
    index.compact(fs, root, grace_s=0)
    _write(url, opts, n=4, prefix="s1")  # sorts between indexed names (s0, s1, s10, ...): inside ranges
    _write(url, opts, n=3, prefix="t", index_every=10**6)
    late = [s for s in fs.ls(storage.join(root, index.INDEX_DIR)) if "/w-" in s and "-t" not in s]
    monkeypatch.setattr(index, "LIST_SPLIT", 4)
    is_list = lambda m, p: m == "GET" and "list-type=2" in p  # noqa: E731
    with FaultProxy(s3_endpoint, faults=["latency"], persistent=True, delay=0.05, match=is_list) as proxy:
        store = hsstore.open(url, endpoint_url=proxy.url)
    lists = [p for m, p in proxy.log if is_list(m, p) and "commits" in p]
    assert len(lists) >= 8 and proxy.max_in_flight >= 4, (len(lists), proxy.max_in_flight)
    direct = hsstore.Store(url, opts, use_index=False)
    assert store.commits == direct.commits and len(store.commits) == 37 and late
    assert store.index_use.shards == 37


@pytest.mark.parametrize("where", ["local", "http"])
def test_a_listing_cut_by_the_index_is_the_whole_listing_where_ranges_are_not_listed(tmp_path, monkeypatch, where):
    """The index's names cut the listing of ``commits/`` into ranges wherever it is; a backend that lists no ranges
    (local disk, an HTTP index page) lists it whole, and a store opens on that listing as without the index."""
    _write(str(tmp_path / "store"))
    monkeypatch.setattr(index, "LIST_SPLIT", 4)
    with HostileHTTPServer(str(tmp_path)) as srv:
        url = str(tmp_path / "store") if where == "local" else f"{srv.url}/store"
        fs, root = storage.resolve(url)
        known = commit.list_committed(fs, root)
        assert len(known) == N_SHARDS
        assert index.listed_records(fs, root, known) == index.listed_records(fs, root)
        assert hsstore.open(url).commits == hsstore.Store(url, use_index=False).commits


def test_records_gone_from_the_end_of_a_block_still_read(tmp_path):
    """A record removed from commits/ after it was indexed drops its row, not its bytes from the row's block:
    the records before it are still read (in this process and from an ``open_shared`` payload), with the
    block decompressed to its full size, not the end of the rows that are left."""
    url = str(tmp_path)
    _write(url, n=4)
    names = commit.list_committed(_local_fs(), url)
    os.remove(os.path.join(url, commit.commit_path(names[-1])))  # the last record of the writer's one block
    store = hsstore.open(url)
    assert [c.shard for c in store.commits] == names[:-1] and store.index_use.indexed == 3
    assert [store.read(i)["sample_id"] for i in range(len(store))] == ["s0", "s1", "s2"]
    from hsstore.store import broadcast

    data = broadcast.encode(store.manifest, store.index_use, store.table)
    (n,) = struct.unpack("<I", data[:4])
    table = index.decode_segment("shared", data[4 + n:]).table
    assert [records.Records(table, fallback=None)[i].shard for i in range(len(table))] == names[:-1]


def test_a_store_copied_with_cp_r_keeps_its_index_by_content(tmp_path, capsys):
    """``cp -r`` gives every record a new file time: its entries still hold the same bytes (their CRC32C, checked
    where the record is read anyway), so verify calls no shard unindexed; an entry whose record was rewritten with
    the same size stays outdated; ``hsstore index`` restamps the copy, whose opening then reads no record."""
    import subprocess

    url, copy = str(tmp_path / "s"), str(tmp_path / "copy")
    _write(url)
    subprocess.run(["cp", "-r", url, copy], check=True)
    store = hsstore.open(copy)
    assert store.index_use.stale == [] and len(store.index_use.restamped) == N_SHARDS
    capsys.readouterr()
    assert main(["verify", copy, "-q"]) == 0
    assert "not in the index" not in capsys.readouterr().out
    first = store.commits[3]
    new = dataclasses.replace(first, created_at="2099" + first.created_at[4:])  # same size, other bytes
    commit.publish(_local_fs(), copy, new)
    again = hsstore.open(copy)
    assert again.index_use.stale == [first.shard] and len(again.index_use.restamped) == N_SHARDS - 1
    assert again.record(first.shard).created_at == new.created_at
    assert main(["verify", copy, "-q", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)["index"]
    assert report["unindexed_shards"] == 1 and report["restamped_shards"] == N_SHARDS - 1
    assert main(["index", copy, "--grace", "0", "-q"]) == 0
    assert hsstore.open(copy).index_use.fetched == 0
