"""Commit records bind each checksummed object's content to its path: a valid chunk (or wds member) in the
wrong place -- swapped between shards of equal size, copied from another store -- is named by verify
(shard, file, samples) and refused by ``Store.read`` and the loader (or skipped and counted with
``skip_corrupt``). Stores written before this (record format version 1) still read; verify says once
that their chunk checksums cannot tell chunks apart, and ``hsstore upgrade`` re-derives them, safely
interrupted and re-run."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import numpy as np
import pytest
import torch

import hsstore
from hsstore.format import commit
from hsstore.io import storage, transfer
from hsstore.layouts import wds
from hsstore.app.cli import main
from hsstore.errors import CorruptionError
from hsstore.ops.verify import verify

from conftest import make_manifest, make_samples
from test_loader import dataset, ids_of, write_store

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")

# CRC-32C is "CRC-32/ISCSI" in the RevEng CRC catalogue: residue 0xb798b438, xorout 0xffffffff. The CRC of
# any message followed by its own CRC (little-endian) is therefore this one constant, whatever the message:
# what records of format version 1 list for every valid chunk object.
CRC32C_OF_ANY_VALID_CHUNK = 0xB798B438 ^ 0xFFFFFFFF


def crc32c(data: bytes) -> int:
    """CRC-32C computed here bit by bit (reflected polynomial 0x82F63B78), independent of hsstore.format.codec."""
    crc = 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def swap(a, b) -> None:
    da, db = open(a, "rb").read(), open(b, "rb").read()
    assert len(da) == len(db) and da != db
    open(a, "wb").write(db)
    open(b, "wb").write(da)


def chunk_samples(rec, k: int, ct: int) -> list[str]:
    """Sample ids with a token in chunk ``k`` (tokens k*ct .. (k+1)*ct), from the record's lengths."""
    ids, ends = rec.samples["sample_id"], np.cumsum(rec.samples["length"])
    starts = ends - np.asarray(rec.samples["length"])
    return [ids[i] for i in range(rec.n_samples) if starts[i] < (k + 1) * ct and ends[i] > k * ct]


def chunk_key(rec, array: str, k: int) -> str:
    return f"shards/{rec.shard}/{array}/c/{k}" + ("/0" if array.startswith("layer_") else "")


def assert_named(report, rec, key, samples):
    hit = [p for p in report.problems if p.shard == rec.shard and p.file == key]
    assert hit, [str(p) for p in report.problems]
    assert hit[0].samples == samples and "not the one" in hit[0].message, str(hit[0])


def fp8_manifest(**kw):
    return dataclasses.replace(make_manifest(**kw), encoding="fp8")


# -- zarr: valid chunks in the wrong place ------------------------------------------------------------

@pytest.mark.parametrize("array,encoding", [("layer_003", "raw"), ("input_ids", "raw"), ("scale_003", "fp8")])
def test_equal_size_chunks_swapped_between_shards(tmp_path, array, encoding, capsys):
    samples = make_samples(30)
    manifest = fp8_manifest(chunk_tokens=64) if encoding == "fp8" else make_manifest(chunk_tokens=64)
    url = write_store(str(tmp_path / "s"), samples, manifest=manifest, shard_tokens=600)
    store = hsstore.open(url)
    a, b = store.commits[0], store.commits[1]
    ka, kb = chunk_key(a, array, 1), chunk_key(b, array, 1)
    swap(os.path.join(url, ka), os.path.join(url, kb))
    hit_a, hit_b = chunk_samples(a, 1, 64), chunk_samples(b, 1, 64)

    report = verify(hsstore.open(url))
    assert not report.ok
    assert_named(report, a, ka, hit_a)
    assert_named(report, b, kb, hit_b)
    assert main(["verify", url, "-q"]) == 1
    assert f"FAIL shard {a.shard}, file {ka}: " in capsys.readouterr().out

    victim = store.sample_ids().index(hit_a[0])
    with pytest.raises(CorruptionError, match=rf"sample '{hit_a[0]}'.*{ka}.*not the one"):
        store.read(victim)
    with pytest.raises(CorruptionError, match=rf"shard '({a.shard}|{b.shard})', sample .*not the one"):
        list(dataset(url))
    ds = dataset(url, skip_corrupt=True)
    assert sorted(ids_of(ds)) == sorted({s["sample_id"] for s in samples} - set(hit_a) - set(hit_b))
    assert sum(ds.state_dict()["skipped"].values()) == len(hit_a) + len(hit_b)


def test_chunk_replaced_by_valid_chunk_of_another_store(tmp_path):
    ua = write_store(str(tmp_path / "a"), make_samples(20, seed=1), shard_tokens=600)
    ub = write_store(str(tmp_path / "b"), make_samples(20, seed=2, prefix="t"), shard_tokens=600)
    a, b = hsstore.open(ua).commits[0], hsstore.open(ub).commits[0]
    key = chunk_key(a, "layer_001", 0)
    shutil.copyfile(os.path.join(ub, chunk_key(b, "layer_001", 0)), os.path.join(ua, key))
    hit = chunk_samples(a, 0, 64)
    assert_named(verify(hsstore.open(ua)), a, key, hit)
    store = hsstore.open(ua)
    with pytest.raises(CorruptionError, match=rf"sample '{hit[0]}'.*{key}.*not the one"):
        store.read(store.sample_ids().index(hit[0]))
    with pytest.raises(CorruptionError, match=rf"shard '{a.shard}', sample .*not the one"):
        list(dataset(ua))
    assert len(ids_of(dataset(ua, layers=[3, 5]))) == 20  # the other layers are untouched


def test_swap_on_s3_refused_through_fetch_and_chunk_cache(s3_store, tmp_path):
    """Remote reads decode fetched objects (not the local direct path); a cached copy must match too."""
    url, opts = s3_store
    samples = make_samples(12)
    write_store(url, samples, shard_tokens=600, storage_options=opts)
    store = hsstore.open(url, **opts)
    a, b = store.commits[0], store.commits[1]
    ka, kb = chunk_key(a, "layer_005", 0), chunk_key(b, "layer_005", 0)
    # valid chunks at the wrong paths of the local chunk cache: dropped and fetched again, the epoch exact
    cache = str(tmp_path / "cache")
    assert len(ids_of(dataset(url, storage_options=opts, cache_dir=cache))) == 12
    cached = {k: [os.path.join(d, f) for d, _, fs_ in os.walk(cache) for f in fs_ if d.endswith(k.rsplit("/", 1)[0])]
              for k in (ka, kb)}
    swap(cached[ka][0], cached[kb][0])
    by_id = {s["sample_id"]: s for s in samples}
    for item in dataset(url, storage_options=opts, cache_dir=cache):
        want = by_id[item["sample_id"]]["hidden_states"]
        assert torch.equal(item["hidden_states"].view(torch.int16), want.view(torch.int16))
    fs, root = storage.resolve(url, opts)
    da, db = fs.cat_file(storage.join(root, ka)), fs.cat_file(storage.join(root, kb))
    fs.pipe({storage.join(root, ka): db, storage.join(root, kb): da})
    hit = chunk_samples(a, 0, 64)
    assert_named(verify(hsstore.open(url, **opts)), a, ka, hit)
    with pytest.raises(CorruptionError, match=rf"{ka}.*not the one"):
        hsstore.open(url, **opts).read(store.sample_ids().index(hit[0]))
    with pytest.raises(CorruptionError, match="not the one"):
        list(dataset(url, storage_options=opts, cache_dir=str(tmp_path / "fresh-cache")))


# -- wds: a valid member in the wrong place -----------------------------------------------------------

def wds_store(url, samples):
    return write_store(url, samples, manifest=dataclasses.replace(make_manifest(), layout="wds"), shard_tokens=600)


def member_bytes(store, rec, member):
    off, size, _ = rec.members[member]
    with open(os.path.join(store.root, wds.tar_path(rec.shard)), "rb") as f:
        f.seek(off)
        return f.read(size)


def put_member(store, rec, member, data):
    off, size, _ = rec.members[member]
    assert len(data) == size
    with open(os.path.join(store.root, wds.tar_path(rec.shard)), "r+b") as f:
        f.seek(off)
        f.write(data)


@pytest.mark.parametrize("source", ["other shard", "other store"])
def test_wds_member_swapped_or_replaced(tmp_path, source):
    samples = make_samples(12, min_len=80, max_len=81)  # equal lengths: equal-size members
    url = wds_store(str(tmp_path / "a"), samples)
    store = hsstore.open(url)
    a = store.commits[0]
    member = "000001.layer_003.npy"
    if source == "other shard":
        b = store.commits[1]
        da, db = member_bytes(store, a, member), member_bytes(store, b, member)
        put_member(store, a, member, db)
        put_member(store, b, member, da)
    else:
        other = hsstore.open(wds_store(str(tmp_path / "b"), make_samples(12, seed=5, min_len=80, max_len=81)))
        put_member(store, a, member, member_bytes(other, other.commits[0], member))
    sid = a.samples["sample_id"][1]
    report = verify(hsstore.open(url))
    assert any(p.shard == a.shard and p.file == wds.tar_path(a.shard) and member in p.message and p.samples == [sid]
               for p in report.problems), [str(p) for p in report.problems]
    with pytest.raises(CorruptionError, match=rf"shard '{a.shard}', member '{member}'"):
        store.read(store.sample_ids().index(sid))
    with pytest.raises(CorruptionError, match=rf"shard '{a.shard}', sample '{sid}'.*{member}"):
        list(dataset(url))
    ds = dataset(url, skip_corrupt=True)
    lost = {sid} | ({store.commits[1].samples["sample_id"][1]} if source == "other shard" else set())
    assert sorted(ids_of(ds)) == sorted({s["sample_id"] for s in samples} - lost)


# -- what each record lists ---------------------------------------------------------------------------

def test_record_checksums_identify_content(tmp_path):
    """Every file's checksum differs between objects of different content; a chunk's is its payload's CRC32C
    (= the tail the reader checks); wds members and the tar list the CRC32C of their own bytes."""
    url = write_store(str(tmp_path / "z"), make_samples(10), manifest=fp8_manifest(chunk_tokens=64), shard_tokens=600)
    rec = hsstore.open(url).commits[0]
    assert rec.format_version == 2
    chunks = 0
    for key, entry in rec.files.items():
        data = open(os.path.join(url, key), "rb").read()
        if "/c/" in key:  # a chunk object: payload + CRC32C of the payload
            chunks += 1
            assert crc32c(data) == CRC32C_OF_ANY_VALID_CHUNK  # the whole object's CRC says nothing
            assert entry["crc32c"] == crc32c(data[:-4]) == int.from_bytes(data[-4:], "little")
        else:
            assert entry["crc32c"] == crc32c(data)
    assert chunks > 10 and len({e["crc32c"] for e in rec.files.values()}) > chunks // 2
    wurl = wds_store(str(tmp_path / "w"), make_samples(4))
    wstore = hsstore.open(wurl)
    wrec = wstore.commits[0]
    tar = open(os.path.join(wurl, wds.tar_path(wrec.shard)), "rb").read()
    assert wrec.files[wds.tar_path(wrec.shard)]["crc32c"] == crc32c(tar)
    for name, (off, size, crc) in wrec.members.items():
        assert crc == crc32c(tar[off:off + size])


def test_newer_record_version_refused(tmp_path):
    url = write_store(str(tmp_path / "s"), make_samples(5))
    path = os.path.join(url, commit.commit_path(hsstore.open(url).commits[0].shard))
    d = json.loads(open(path).read())
    open(path, "w").write(json.dumps({**d, "format_version": 3}))
    with pytest.raises(hsstore.StoreError, match="format version 3.*upgrade hsstore"):
        hsstore.open(url)


# -- stores written before: read, warned about once, upgraded -----------------------------------------

def downgrade(url: str) -> None:
    """Make a store exactly what hsstore wrote before content checksums: manifest and records of format
    version 1, every chunk listed with the CRC32C of its whole object."""
    mpath = os.path.join(url, "manifest.json")
    m = json.loads(open(mpath).read())
    open(mpath, "w").write(json.dumps({**m, "format_version": 1}))
    for name in os.listdir(os.path.join(url, "commits")):
        path = os.path.join(url, "commits", name)
        d = json.loads(open(path).read())
        for key, entry in d["files"].items():
            entry["crc32c"] = crc32c(open(os.path.join(url, key), "rb").read())
        open(path, "w").write(json.dumps({**d, "format_version": 1}))


def record_bytes(url):
    names = sorted(n for n in os.listdir(os.path.join(url, "commits")) if not n.startswith("."))
    return {n: open(os.path.join(url, "commits", n), "rb").read() for n in names}


def test_old_store_reads_warns_once_and_upgrade_binds_chunks(tmp_path, capsys):
    samples = make_samples(30)
    url = write_store(str(tmp_path / "s"), samples, shard_tokens=600)
    downgrade(url)
    old = hsstore.open(url)
    assert len(old.commits) >= 3
    chunk_crcs = {e["crc32c"] for c in old.commits for k, e in c.files.items() if "/c/" in k}
    assert chunk_crcs == {CRC32C_OF_ANY_VALID_CHUNK}  # what the issue saw in real stores
    assert sorted(ids_of(dataset(url))) == sorted(s["sample_id"] for s in samples)  # reads as before

    report = verify(old)
    assert report.ok and report.weak_records == [c.shard for c in old.commits]
    assert main(["verify", url, "-q"]) == 0
    out = capsys.readouterr().out
    assert out.count("cannot tell") == 1 and out.count(f"hsstore upgrade {url}") == 1, out

    # the weakness itself: on a copy, a swap passes verify of a version-1 store
    copy = str(tmp_path / "copy")
    shutil.copytree(url, copy)
    c0, c1 = old.commits[0], old.commits[1]
    swap(os.path.join(copy, chunk_key(c0, "layer_003", 0)), os.path.join(copy, chunk_key(c1, "layer_003", 0)))
    assert verify(hsstore.open(copy)).ok

    assert main(["upgrade", url, "-q"]) == 0
    assert f"{len(old.commits)} commit record(s) rewritten" in capsys.readouterr().out
    new = hsstore.open(url)
    assert new.manifest.format_version == 2 and {c.format_version for c in new.commits} == {2}
    for c in new.commits:
        for key, entry in c.files.items():
            data = open(os.path.join(url, key), "rb").read()
            want = int.from_bytes(data[-4:], "little") if "/c/" in key else crc32c(data)
            assert entry["crc32c"] == want and entry["size"] == len(data)
        assert dataclasses.replace(c, files={}, format_version=1) == dataclasses.replace(
            old.record(c.shard), files={})  # nothing else of the record changed
    before = record_bytes(url)
    assert main(["upgrade", url, "-q"]) == 0  # idempotent
    assert "0 commit record(s) rewritten" in capsys.readouterr().out and record_bytes(url) == before
    report = verify(new)
    assert report.ok and report.weak_records == []
    assert sorted(ids_of(dataset(url))) == sorted(s["sample_id"] for s in samples)

    ka, kb = chunk_key(c0, "layer_003", 0), chunk_key(c1, "layer_003", 0)
    swap(os.path.join(url, ka), os.path.join(url, kb))
    assert_named(verify(hsstore.open(url)), c0, ka, chunk_samples(c0, 0, 64))
    with pytest.raises(CorruptionError, match="not the one"):
        list(dataset(url))


def test_upgrade_interrupted_loses_nothing_and_resumes(tmp_path, monkeypatch):
    """Killed between records and inside a record's write (a temporary file left, no rename): every record is
    either the old or the new one, the store reads as before, and a re-run finishes the job."""
    from hsstore.ops import upgrade as upgrade_mod

    samples = make_samples(30)
    url = write_store(str(tmp_path / "s"), samples, shard_tokens=600)
    downgrade(url)
    before = record_bytes(url)
    assert len(before) >= 3
    real, calls = transfer.put_atomic, []

    def dies_on_third(fs, path, data, root=None):
        if "/commits/" not in path.replace(os.sep, "/"):  # a writer's heartbeat thread (another test's): not upgrade's
            return real(fs, path, data, root)
        calls.append(path)
        if len(calls) == 3:  # as if killed after writing the temporary file, before the rename
            tmp = os.path.join(os.path.dirname(path), f".tmp-deadbeef-{os.path.basename(path)}")
            open(tmp, "wb").write(data[: len(data) // 2])
            raise KeyboardInterrupt
        real(fs, path, data, root)

    monkeypatch.setattr(transfer, "put_atomic", dies_on_third)
    with pytest.raises(KeyboardInterrupt):
        upgrade_mod.upgrade(hsstore.open(url))
    monkeypatch.setattr(transfer, "put_atomic", real)
    mid = record_bytes(url)
    assert sorted(mid) == sorted(before)  # no record lost, the debris is not a record
    versions = [json.loads(b)["format_version"] for b in mid.values()]
    assert versions.count(2) == 2 and versions.count(1) == len(before) - 2
    assert sorted(ids_of(dataset(url))) == sorted(s["sample_id"] for s in samples)
    r = upgrade_mod.upgrade(hsstore.open(url))
    assert r.rewritten == len(before) - 2 and r.current == 2 and not r.refused and r.manifest_upgraded
    assert verify(hsstore.open(url)).ok


def test_upgrade_leaves_a_damaged_shard_as_it_was(tmp_path, capsys):
    """A record is rewritten only after every chunk of its shard was re-read and its own CRC32C checked."""
    url = write_store(str(tmp_path / "s"), make_samples(30), shard_tokens=600)
    downgrade(url)
    store = hsstore.open(url)
    bad = store.commits[1]
    path = os.path.join(url, chunk_key(bad, "layer_005", 0))
    data = bytearray(open(path, "rb").read())
    data[10] ^= 0xFF
    open(path, "wb").write(bytes(data))
    before = record_bytes(url)
    assert main(["upgrade", url, "-q"]) == 1
    out = capsys.readouterr().out
    assert f"FAIL shard {bad.shard}, file {chunk_key(bad, 'layer_005', 0)}: checksum mismatch" in out
    after = hsstore.open(url)
    assert {c.shard: c.format_version for c in after.commits} == {
        c.shard: 1 if c.shard == bad.shard else 2 for c in store.commits}
    assert record_bytes(url)[f"{bad.shard}.json"] == before[f"{bad.shard}.json"]
    assert after.manifest.format_version == 1  # not every record is current yet


# -- merge and convert keep the binding ----------------------------------------------------------------

def test_merge_by_reference_and_copy_keep_binding_and_old_records_upgrade(tmp_path, monkeypatch):
    monkeypatch.setenv("HSSTORE_ALLOW_LOCATIONS", str(tmp_path))  # ref's shards are read from a and b
    from hsstore.ops.merge import merge

    sa = make_samples(12, seed=1)
    a = write_store(str(tmp_path / "a"), sa, shard_tokens=600)
    downgrade(a)  # an old source: its records are copied as they are, and still mean what they meant
    b = write_store(str(tmp_path / "b"), make_samples(12, seed=2, prefix="t"), shard_tokens=600)
    ref, cp = str(tmp_path / "ref"), str(tmp_path / "cp")
    merge(ref, [a, b], by="reference", progress=False)
    merge(cp, [a, b], by="copy", progress=False)
    for url in (ref, cp):
        store = hsstore.open(url)
        report = verify(store)
        assert report.ok and set(report.weak_records) == {c.shard for c in hsstore.open(a).commits}
    assert main(["upgrade", ref, "-q"]) == 0  # rewrites ref's records; the referenced files are only read
    ref_store = hsstore.open(ref)
    assert {c.format_version for c in ref_store.commits} == {2} and all(c.location for c in ref_store.commits)
    assert {c.format_version for c in hsstore.open(a).commits} == {1}
    # a re-run of the merge after the upgrade: the shards are already there (same files), nothing refused
    r = merge(ref, [a, b], by="reference", progress=False)
    assert r.shards == 0 and r.already == len(ref_store.commits)
    # a swap in a referenced store is now caught through the destination's records
    s0, s1 = hsstore.open(a).commits[:2]
    swap(os.path.join(a, chunk_key(s0, "layer_001", 0)), os.path.join(a, chunk_key(s1, "layer_001", 0)))
    assert_named(verify(hsstore.open(ref)), s0, chunk_key(s0, "layer_001", 0), chunk_samples(s0, 0, 64))
    # merge by copy checks what it copies against the source record: a swapped v2 chunk is refused
    c = str(tmp_path / "c2")
    b0, b1 = hsstore.open(b).commits[:2]
    swap(os.path.join(b, chunk_key(b0, "input_ids", 0)), os.path.join(b, chunk_key(b1, "input_ids", 0)))
    with pytest.raises(CorruptionError, match=rf"shard '?{b0.shard}'?, file {chunk_key(b0, 'input_ids', 0)}"):
        merge(c, [b], by="copy", progress=False)  # (refused as its token arrays are read, before any copy)


def test_convert_and_subset_write_content_checksums(tmp_path):
    from hsstore.ops.convert import convert
    from hsstore.ops.subset import SampleFilter, subset

    src = write_store(str(tmp_path / "src"), make_samples(10), shard_tokens=600)
    downgrade(src)
    for dst, run in ((str(tmp_path / "w"), lambda d: convert(src, d, "wds")),
                     (str(tmp_path / "z"), lambda d: convert(src, d, "zarr")),
                     (str(tmp_path / "sub"), lambda d: subset(src, d, SampleFilter(min_length=50), progress=False))):
        run(dst)
        store = hsstore.open(dst)
        assert {c.format_version for c in store.commits} == {2}
        report = verify(store)
        assert report.ok and report.weak_records == []


def test_assets_swapped_refused(tmp_path):
    """Asset files are listed with the CRC32C of their own bytes: two of equal size swapped (embedding and
    lm_head have the same shape) are refused by name."""
    from hsstore.format import assets

    url = write_store(str(tmp_path / "s"), make_samples(3))
    fs, root = storage.resolve(url)
    g = torch.Generator().manual_seed(0)
    assets.write_assets(fs, root, {assets.EMBED: assets.tensors_bytes({"weight": torch.randn(64, 48, generator=g)}),
                                   assets.LM_HEAD: assets.tensors_bytes({"weight": torch.randn(64, 48, generator=g)})})
    swap(os.path.join(url, "assets", assets.EMBED), os.path.join(url, "assets", assets.LM_HEAD))
    for name in (assets.EMBED, assets.LM_HEAD):
        with pytest.raises(CorruptionError, match=rf"asset '{name}' does not match its checksum"):
            assets.load_tensors(fs, root, name, url)
