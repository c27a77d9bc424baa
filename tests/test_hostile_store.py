"""Hostile stores (issue #26, items 1-4 and 8): small stores made by hand with valid checksums and forged names.

Every name a store holds (asset names, commit-record file keys, `location`s, index segments' `supersedes`, the
chunk-cache paths made from them) must stay under the root it belongs to; a forged one is refused in one line
naming it, `verify` reports it as a FAIL instead of following it, and nothing outside is written, read into a
store or deleted. S3 cases run against moto's server on loopback (conftest), whose keys keep `..` as bytes.
"""

from __future__ import annotations

import json
import os
import re
import struct
import uuid

import crc32c
import pytest
from numcodecs import Zstd

import hsstore
from hsstore.app.cli import main
from hsstore.errors import StoreError
from hsstore.ops.verify import verify

from conftest import make_manifest, make_samples, write_samples

ALLOW_ENV = "HSSTORE_ALLOW_LOCATIONS"
PRECIOUS = b"precious user data\n"
MAGIC = b"HSSIDX2\n"  # docs/FORMAT.md, "Index": a version-2 segment's first bytes


def _store(url, n=6, shard_tokens=300, opts=None):
    write_samples(url, make_manifest(), make_samples(n, max_len=90), shard_bytes=shard_tokens * 3 * 48 * 2,
                  storage_options=opts or {})
    return url


def _victim(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(PRECIOUS)
    return path


def _crc(data: bytes) -> int:
    return crc32c.crc32c(data)


def _entry(data: bytes) -> dict:
    return {"size": len(data), "crc32c": _crc(data)}


def _add_asset_entry(root, name: str, data: bytes, extra: dict[str, bytes] | None = None) -> None:
    """List ``name`` in ``root/assets/index.json`` (with a valid size and CRC32C), beside ordinary assets."""
    idx_path = os.path.join(root, "assets", "index.json")
    os.makedirs(os.path.dirname(idx_path), exist_ok=True)
    index = json.load(open(idx_path)) if os.path.exists(idx_path) else {"files": {}}
    for k, v in (extra or {"config.json": b"{}"}).items():
        with open(os.path.join(root, "assets", k), "wb") as f:
            f.write(v)
        index["files"][k] = _entry(v)
    index["files"][name] = _entry(data)
    with open(idx_path, "w") as f:
        json.dump(index, f)


# -- segment forging (format: docs/FORMAT.md "Index": magic, u32 header length, JSON header, columns, blocks, CRC) --
def _split_segment(data: bytes):
    (hl,) = struct.unpack("<I", data[len(MAGIC):len(MAGIC) + 4])
    pos = len(MAGIC) + 4
    header = json.loads(data[pos:pos + hl])
    return header, data[pos + hl:-4]


def _join_segment(header: dict, rest: bytes) -> bytes:
    hb = json.dumps(header, separators=(",", ":")).encode()
    body = MAGIC + struct.pack("<I", len(hb)) + hb + rest
    return body + struct.pack("<I", _crc(body))


def _segments(root):
    d = os.path.join(root, "index")
    return sorted(os.path.join(d, n) for n in os.listdir(d) if n.endswith(".idx"))


# ================================================================ 1. `hsstore index` deletes what `supersedes` names
def test_index_never_deletes_what_a_forged_supersedes_names(tmp_path, capsys):
    url = _store(str(tmp_path / "store"))
    victim = _victim(tmp_path / "victim.txt")  # store/index/../../victim.txt
    record = sorted(os.listdir(tmp_path / "store" / "commits"))[0]
    forged = ["../../victim.txt", "../manifest.json", f"../commits/{record}"]
    # a segment of the store's own (valid checksum) claiming to supersede them, created in 1970 (past any grace);
    # stamp 0 is what a never-listed name defaulted to
    header, rest = _split_segment(open(_segments(url)[0], "rb").read())
    header.update(created_unix=0.0, kind="compacted", supersedes={n: 0 for n in forged})
    (tmp_path / "store" / "index" / "c-19700101T000000Z-x-deadbeef.idx").write_bytes(_join_segment(header, rest))
    n = len(hsstore.open(url))

    capsys.readouterr()
    assert main(["verify", url, "-q"]) == 1  # the forged name is a FAIL, named
    out = capsys.readouterr().out
    assert re.search(r"FAIL .*index segment.*'\.\./\.\./victim\.txt'", out), out
    for grace in ([], ["--grace", "0"]):
        assert main(["index", url, *grace]) == 0
        assert victim.read_bytes() == PRECIOUS
        assert (tmp_path / "store" / "manifest.json").exists()
        assert (tmp_path / "store" / "commits" / record).exists()
        assert len(hsstore.open(url)) == n
    # the compaction superseded the forged segment and, with --grace 0, removed it: the index is clean again
    assert not (tmp_path / "store" / "index" / "c-19700101T000000Z-x-deadbeef.idx").exists()
    capsys.readouterr()
    assert main(["verify", url, "-q"]) == 0, capsys.readouterr().out


# ================================================================ 2. `hsstore show` writes an asset to an absolute path
def test_show_and_verify_refuse_an_absolute_asset_name(tmp_path, capsys):
    url = _store(str(tmp_path / "store"))
    victim = _victim(tmp_path / "elsewhere" / "victim.txt")
    name = f"tokenizer/{victim}"  # tokenizer//abs/path: joined with the destination, an absolute path
    payload = b"attacker bytes"
    # where a reader joining root/assets/<name> finds it (`//` collapses on local disk)
    hidden = tmp_path / "store" / "assets" / "tokenizer" / str(victim).lstrip("/")
    hidden.parent.mkdir(parents=True)
    hidden.write_bytes(payload)
    _add_asset_entry(str(tmp_path / "store"), name, payload, {"tokenizer/tokenizer.json": b"{}"})

    capsys.readouterr()
    assert main(["show", url, "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and repr(name) in err, err
    assert victim.read_bytes() == PRECIOUS
    assert main(["verify", url, "-q"]) == 1
    out = capsys.readouterr().out
    assert re.search(r"FAIL shard \(assets\).*" + re.escape(repr(name)), out), out


@pytest.mark.parametrize("name", ["tokenizer//x.json", "/abs/x.json", "tokenizer\\x.json", "tokenizer/./x.json"])
def test_verify_fails_naming_an_asset_name_with_an_empty_absolute_backslash_or_dot_part(tmp_path, capsys, name):
    url = _store(str(tmp_path / "store"))
    payload = b"{}"
    # the bytes where a reader that joins root/assets/<name> lexically finds them
    hidden = tmp_path / "store" / "assets" / name.replace("//", "/").replace("/./", "/").lstrip("/")
    hidden.parent.mkdir(parents=True, exist_ok=True)
    hidden.write_bytes(payload)
    _add_asset_entry(str(tmp_path / "store"), name, payload)
    capsys.readouterr()
    assert main(["verify", url, "-q"]) == 1
    out = capsys.readouterr().out
    assert re.search(r"FAIL shard \(assets\).*asset name " + re.escape(repr(name)) + " refused", out), out


# ================================================================ 3. copiers overwrite a file outside DST
def _hostile_local_assets(tmp_path):
    """A local store whose asset `lnk/../../../victim.txt` reads, through a link inside it, the attacker's
    payload (valid size and CRC32C); written into DST/assets/ it climbs to DST's parent."""
    src = _store(str(tmp_path / "src"))
    deep = tmp_path / "evil" / "d1" / "d2" / "d3"
    deep.mkdir(parents=True)
    payload = b"attacker bytes"
    (tmp_path / "evil" / "victim.txt").write_bytes(payload)
    name = "lnk/../../../victim.txt"
    _add_asset_entry(src, name, payload)
    os.symlink(deep, tmp_path / "src" / "assets" / "lnk")
    return src, name, {}


def _hostile_s3_assets(tmp_path, s3_store):
    """An S3 store whose asset key is `assets/../../victim.txt` (just a key there): no link needed."""
    import s3fs

    url, opts = s3_store
    src = _store(url, opts=opts)
    fs = s3fs.S3FileSystem(endpoint_url=opts["endpoint_url"], skip_instance_cache=True)
    root = src[len("s3://"):]
    payload, name = b"attacker bytes", "../../victim.txt"
    fs.pipe_file(f"{root}/assets/config.json", b"{}")
    fs.pipe_file(f"{root}/assets/{name}", payload)
    fs.pipe_file(f"{root}/assets/index.json", json.dumps({"files": {"config.json": _entry(b"{}"),
                                                                    name: _entry(payload)}}).encode())
    return src, name, opts


def _copy(command, src, dst, opts):
    from hsstore.ops.convert import convert
    from hsstore.ops.merge import merge
    from hsstore.ops.subset import SampleFilter, subset

    if command == "subset":
        subset(src, dst, SampleFilter(), src_options=opts, progress=False)
    elif command == "convert":
        convert(src, dst, "wds", src_options=opts)
    else:
        merge(dst, [src], by=command.split("-")[1], src_options=opts, progress=False)


@pytest.mark.parametrize("kind", ["local", "s3"])
@pytest.mark.parametrize("command", ["subset", "merge-copy", "merge-reference", "convert"])
def test_copiers_refuse_asset_names_that_leave_the_destination(tmp_path, request, kind, command):
    if kind == "local":
        src, name, opts = _hostile_local_assets(tmp_path)
    else:
        src, name, opts = _hostile_s3_assets(tmp_path, request.getfixturevalue("s3_store"))
    victim = _victim(tmp_path / "victim.txt")
    dst = str(tmp_path / "dst")  # dst/assets/../../victim.txt is tmp_path/victim.txt
    with pytest.raises(StoreError, match=re.escape(repr(name))) as e:
        _copy(command, src, dst, opts)
    assert len(str(e.value).splitlines()) == 1 and "asset name" in str(e.value)
    assert victim.read_bytes() == PRECIOUS
    assert verify(hsstore.open(src, **opts)).problems  # and verify names it
    assert any(name in str(p) for p in verify(hsstore.open(src, **opts)).problems)


def test_merge_by_copy_refuses_a_file_key_that_leaves_the_shard(tmp_path, capsys):
    src = _store(str(tmp_path / "src"))
    deep = tmp_path / "evil" / "d1" / "d2" / "d3"
    deep.mkdir(parents=True)
    payload = b"attacker bytes"
    (tmp_path / "evil" / "victim.txt").write_bytes(payload)
    os.symlink(deep, tmp_path / "src" / "shards" / "lnk")
    key = "shards/lnk/../../../victim.txt"  # read through the link: the payload; in DST: tmp_path/victim.txt
    rec_path = sorted((tmp_path / "src" / "commits").glob("*.json"))[0]
    rec = json.loads(rec_path.read_text())
    rec["files"][key] = _entry(payload)
    rec_path.write_text(json.dumps(rec))
    victim = _victim(tmp_path / "victim.txt")

    capsys.readouterr()
    assert main(["merge", str(tmp_path / "dst"), src, "--by", "copy", "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and repr(key) in err, err
    assert victim.read_bytes() == PRECIOUS
    assert not (tmp_path / "dst" / "commits").exists() or not list((tmp_path / "dst" / "commits").iterdir())
    assert main(["verify", src, "-q"]) == 1
    out = capsys.readouterr().out
    assert re.search(rf"FAIL shard {rec['shard']}, file {re.escape(key)}: unsafe name", out), out


# ================================================================ 4. locations: the chunk cache, /etc, merge by reference
def _s3_store_by_location(tmp_path, s3_store, location_of):
    """Store A (real data) on S3 and store B whose commit records are A's with ``location_of(bucket)``; A's
    shard objects are also put under that location's literal key (S3 keeps `..` in keys)."""
    import s3fs

    url, opts = s3_store
    bucket = url[len("s3://"):].split("/", 1)[0]
    a = _store(url, n=8, shard_tokens=200, opts=opts)
    location = location_of(bucket)
    fs = s3fs.S3FileSystem(endpoint_url=opts["endpoint_url"], skip_instance_cache=True)
    a_root, far_root = a[len("s3://"):], location[len("s3://"):]
    for path in fs.find(f"{a_root}/shards"):
        fs.pipe_file(far_root + path[len(a_root):], fs.cat_file(path))
    b = f"s3://{bucket}/stores/b-{uuid.uuid4().hex[:6]}"
    b_root = b[len("s3://"):]
    fs.pipe_file(f"{b_root}/manifest.json", fs.cat_file(f"{a_root}/manifest.json"))
    for path in fs.find(f"{a_root}/commits"):
        rec = json.loads(fs.cat_file(path))
        rec["location"] = location
        fs.pipe_file(f"{b_root}/commits/{path.rsplit('/', 1)[1]}", json.dumps(rec).encode())
    return b, opts, bucket


def test_chunk_cache_never_writes_outside_cache_dir(tmp_path, s3_store, monkeypatch):
    from hsstore.loader.dataset import HiddenStateDataset
    from hsstore.loader.options import Planning, Reading

    target = tmp_path / "target"
    target.mkdir()
    b, opts, bucket = _s3_store_by_location(
        tmp_path, s3_store, lambda bk: f"s3://{bk}/" + "../" * 14 + str(target).lstrip("/") + "/src")
    for allow in (None, f"s3://{bucket}"):  # allowing the bucket does not allow climbing out of it
        if allow:
            monkeypatch.setenv(ALLOW_ENV, allow)
        ds = HiddenStateDataset(b, storage_options=opts, reading=Reading(cache_dir=str(tmp_path / "cache")),
                                planning=Planning(shuffle=False))
        with pytest.raises(StoreError, match=r"location '.*\.\./.*' refused") as e:
            list(ds)
        assert len(str(e.value).splitlines()) == 1
        assert [f for _, _, fs_ in os.walk(target) for f in fs_] == []
    # the cache itself refuses a path that climbs out of it, whatever made it
    from hsstore.loader.cache import ChunkCache

    cache = ChunkCache(str(tmp_path / "cache2"), 1 << 20)
    with pytest.raises(StoreError, match="refused"):
        cache.put("ns", "bucket/" + "../" * 8 + str(target).lstrip("/") + "/x", b"chunk")
    assert [f for _, _, fs_ in os.walk(target) for f in fs_] == []


def _etc_store(tmp_path):
    """A local store one of whose records names `/etc` as its location and lists `passwd` and `shadow`."""
    url = _store(str(tmp_path / "store"))
    rec_path = sorted((tmp_path / "store" / "commits").glob("*.json"))[0]
    rec = json.loads(rec_path.read_text())
    rec["location"] = "/etc"
    rec["files"].update({"passwd": {"size": 1, "crc32c": 0}, "shadow": {"size": 1, "crc32c": 0}})
    rec_path.write_text(json.dumps(rec))
    return url, rec["shard"]


def test_verify_never_follows_a_location_of_etc(tmp_path, capsys):
    url, shard = _etc_store(tmp_path)
    for allow in ([], ["--allow-location", "/etc"], ["--allow-location", "/"]):  # system paths: never
        capsys.readouterr()
        assert main(["verify", url, "-q", *allow]) == 1
        out = capsys.readouterr().out
        assert re.search(rf"FAIL shard {shard}, file location: location not followed: .*'/etc' refused", out), out
        assert re.search(rf"FAIL shard {shard}, file passwd: unsafe name", out), out
        assert "size" not in out  # nothing of /etc/passwd or /etc/shadow was read
    with pytest.raises(StoreError, match="'/etc' refused"):
        hsstore.open(url).read(next(i for i in range(len(hsstore.open(url)))
                                    if hsstore.open(url).ref(i).shard == shard))


def test_merge_by_reference_never_passes_on_a_location_it_would_refuse(tmp_path, capsys):
    url, _ = _etc_store(tmp_path)
    dst = tmp_path / "dst"
    capsys.readouterr()
    assert main(["merge", str(dst), url, "--by", "reference", "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'/etc' refused" in err, err
    written = list((dst / "commits").glob("*.json")) if (dst / "commits").exists() else []
    assert not any(json.loads(p.read_text()).get("location") == "/etc" for p in written)
    assert written == []  # refused before the first record


def test_locations_outside_the_store_need_allow_location(tmp_path, capsys, monkeypatch):
    """A sibling store by reference (`../a`, what merge writes) is read only when the user allows its prefix."""
    a = _store(str(tmp_path / "a"))
    ref = str(tmp_path / "ref")
    from hsstore.ops.merge import merge

    monkeypatch.delenv(ALLOW_ENV, raising=False)
    merge(ref, [a], by="reference", progress=False)
    with pytest.raises(StoreError, match=r"location '\.\./a' refused .*outside the store.*--allow-location"):
        hsstore.open(ref).read(0)
    capsys.readouterr()
    assert main(["verify", ref, "-q"]) == 1
    assert main(["verify", ref, "-q", "--allow-location", str(tmp_path / "a")]) == 0
    assert len(hsstore.open(ref, allow_locations=[str(tmp_path / "a")]).read(0)["input_ids"]) > 0


# ================================================================ 8. a junk index block (valid CRC)
def _junk_index_block(url) -> str:
    """Replace the first record's bytes in the store's index segment by junk of the same length, keeping
    every column and giving the segment a valid checksum again. Returns the segment's name."""
    path = _segments(url)[0]
    header, rest = _split_segment(open(path, "rb").read())
    columns, blocks = rest[:header["columns_bytes"]], []
    pos = header["columns_bytes"]
    for n in header["blocks_bytes"]:
        blocks.append(rest[pos:pos + n])
        pos += n
    zstd = Zstd(level=3)
    first = bytearray(zstd.decode(blocks[0]))
    end = first.index(b"}{") + 1 if b"}{" in first else len(first)  # the first record (records are JSON objects)
    first[:end] = b"!" * end
    blocks[0] = bytes(zstd.encode(bytes(first)))
    header["blocks_bytes"] = [len(b) for b in blocks]
    with open(path, "wb") as f:
        f.write(_join_segment(header, columns + b"".join(blocks)))
    return os.path.basename(path)


def test_a_junk_index_block_is_an_index_problem_and_compaction_repairs_it(tmp_path, capsys, caplog):
    url = _store(str(tmp_path / "store"))
    seg = _junk_index_block(url)
    store = hsstore.open(url)
    want = [store.read(i)["input_ids"].tolist() for i in range(len(store))]
    assert want and any(seg in r.getMessage() for r in caplog.records)  # read from the records, segment named

    capsys.readouterr()
    assert main(["verify", url, "-q"]) == 1  # the index is at fault, and only the index
    out = capsys.readouterr().out
    fails = [line for line in out.splitlines() if line.startswith("FAIL")]
    assert fails and all(f"index/{seg}" in line and "index entry" in line for line in fails), out
    assert main(["export", "specforge", url, str(tmp_path / "sf"), "-q"]) == 0

    assert main(["index", url, "--grace", "0"]) == 0  # rebuilt from what it could check
    caplog.clear()
    store = hsstore.open(url)
    assert [store.read(i)["input_ids"].tolist() for i in range(len(store))] == want
    assert store.index_use.indexed == len(store.commits)  # every record served by the new segment
    assert not [r for r in caplog.records if "unusable" in r.getMessage()]
    assert not (tmp_path / "store" / "index" / seg).exists()
    capsys.readouterr()
    assert main(["verify", url, "-q"]) == 0, capsys.readouterr().out
