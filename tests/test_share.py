"""Sharing stores: anonymous read-only S3 access, `hsstore subset`, `hsstore merge` by copy and by reference."""

import json
import os
import shutil

import pytest
import torch

import hsstore
from hsstore.app.cli import main
from hsstore.errors import ManifestError, StoreError
from hsstore.store.reader import committed_ids

SOURCES = ("web", "math", "code")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def write_tagged(url, manifest, samples, storage_options=None, **kw):
    """Samples with per-sample source and flags columns, as extract writes them."""
    with hsstore.StoreWriter(url, manifest, storage_options=storage_options, **kw) as w:
        for i, s in enumerate(samples):
            w.add(s["sample_id"], s["input_ids"], s["loss_mask"], s["hidden_states"], source=SOURCES[i % 3],
                  thinking_tokens=min(i, len(s["input_ids"])), flags=["stub_answer"] if i % 4 == 0 else [])
    return w


def assert_same_samples(url, samples, options=None):
    store = hsstore.open(url, **(options or {}))
    index = {sid: i for i, sid in enumerate(store.sample_ids())}
    assert set(index) == {s["sample_id"] for s in samples}
    for s in samples:
        got = store.read(index[s["sample_id"]])
        assert torch.equal(got["input_ids"], s["input_ids"])
        assert torch.equal(got["loss_mask"], s["loss_mask"])
        assert torch.equal(bits(got["hidden_states"]), bits(s["hidden_states"]))


# ------------------------------------------------------------------------------------------- anonymous S3
def public_read_policy(bucket: str) -> str:
    """What a team sharing a store sets: anyone may list and read, nobody anonymous may write. (moto authorises
    HEAD requests as s3:HeadObject; AWS counts them as s3:GetObject.)"""
    return json.dumps({"Version": "2012-10-17", "Statement": [
        {"Effect": "Allow", "Principal": "*", "Action": ["s3:GetObject", "s3:HeadObject"],
         "Resource": [f"arn:aws:s3:::{bucket}/*"]},
        {"Effect": "Allow", "Principal": "*", "Action": ["s3:ListBucket"], "Resource": [f"arn:aws:s3:::{bucket}"]}]})


def test_anonymous_s3_reads_public_store_and_refuses_writes(s3_store, s3_endpoint, new_manifest, new_samples,
                                                            tiny_dir, capsys):
    import boto3

    url, opts = s3_store
    samples = new_samples(6)
    write_tagged(url, new_manifest(), samples, storage_options=opts)
    anon = ["-S", "anon=true", "-S", f"endpoint_url={s3_endpoint}"]
    # a private bucket: unsigned requests are refused by the endpoint, hsstore says so in one line
    assert main(["info", url, *anon]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cannot read store" in err and "Forbidden" in err
    bucket = url.split("/")[2]
    boto3.client("s3", endpoint_url=s3_endpoint).put_bucket_policy(Bucket=bucket, Policy=public_read_policy(bucket))
    assert main(["info", url, "--json", *anon]) == 0
    assert json.loads(capsys.readouterr().out)["samples"] == 6
    assert main(["verify", url, "-q", *anon]) == 0
    assert "OK" in capsys.readouterr().out
    assert main(["show", url, "s2", "--model", str(tiny_dir), "--color", "never", *anon]) == 0
    assert "# s2 [code]" in capsys.readouterr().out
    store = hsstore.open(url, anon=True, endpoint_url=s3_endpoint)
    assert store.fs.anon  # unsigned requests
    assert_same_samples(url, samples, {"anon": True, "endpoint_url": s3_endpoint})

    import s3fs

    signed = s3fs.S3FileSystem(endpoint_url=s3_endpoint, skip_instance_cache=True)
    unsigned = s3fs.S3FileSystem(endpoint_url=s3_endpoint, anon=True, skip_instance_cache=True)
    unsigned.pipe_file(f"{bucket}/probe", b"x")  # the endpoint itself would take an anonymous write ...
    signed.rm(f"{bucket}/probe")
    listing = sorted(signed.find(bucket))
    # writes with anon=true: refused by hsstore itself
    with pytest.raises(StoreError, match="read-only"):
        hsstore.StoreWriter(url, new_manifest(), storage_options={"anon": True, "endpoint_url": s3_endpoint})
    for argv in (["merge", f"s3://{bucket}/merged", url, *anon], ["subset", url, f"s3://{bucket}/sub", *anon],
                 ["convert", url, f"s3://{bucket}/conv", "--layout", "wds", *anon],
                 ["convert", url, f"s3://{bucket}/conv", "--layout", "wds", "-S", f"endpoint_url={s3_endpoint}",
                  "--dst-storage-option", "anon=true", "--dst-storage-option", f"endpoint_url={s3_endpoint}"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "anon=true opens a store read-only" in err
    assert sorted(signed.find(bucket)) == listing  # ... hsstore refused them all before writing anything


@pytest.mark.parametrize("argv", [
    ["merge", "{dst}", "{src}", "-S", "anon=true"],
    ["subset", "{src}", "{dst}", "-S", "anon=true"],
    ["convert", "{src}", "{dst}", "--layout", "wds", "-S", "anon=true"],  # convert used to write anyway
    ["convert", "{src}", "{dst}", "--layout", "wds", "--dst-storage-option", "anon=true"],
], ids=["merge", "subset", "convert", "convert-dst-option"])
def test_every_writer_refuses_anonymous_destination_alike(tmp_path, new_manifest, new_samples, argv, capsys):
    """One way to open a destination: each command refuses anon=true with the same one line, writing nothing."""
    src, dst = str(tmp_path / "src"), tmp_path / "dst"
    write_tagged(src, new_manifest(), new_samples(3))
    assert main([a.format(src=src, dst=dst) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"hsstore {argv[0]}: error: store {str(dst)!r}: anon=true opens a store read-only; to write, "
                   "drop the anon storage option and give credentials")
    assert not dst.exists()


# ------------------------------------------------------------------------------------------------- subset
def test_subset_by_columns_bit_exact_and_resumable(tmp_path, new_manifest, new_samples, capsys):
    samples = new_samples(30, min_len=3, max_len=120)
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    write_tagged(src, new_manifest(), samples, shard_bytes=20_000)  # several shards
    argv = ["subset", src, dst, "--source", "web", "--source", "math", "--min-length", "20", "--max-length", "100",
            "--min-loss-tokens", "10", "--exclude-flag", "stub_answer", "-q"]
    want = [s for i, s in enumerate(samples)
            if SOURCES[i % 3] in ("web", "math") and 20 <= len(s["input_ids"]) <= 100
            and int(s["loss_mask"].sum()) >= 10 and i % 4 != 0]
    assert 3 <= len(want) < 20
    assert main(argv) == 0
    assert f"{len(want)} written" in capsys.readouterr().out
    assert_same_samples(dst, want)
    a, b = hsstore.open(src), hsstore.open(dst)
    assert a.manifest.compat_key() == b.manifest.compat_key() and b.manifest.extra["subset_of"] == src
    rows = {sid: (c.samples["source"][k], c.samples["flags"][k], c.samples["thinking_tokens"][k])
            for c in b.commits for k, sid in enumerate(c.samples["sample_id"])}
    for s in want:  # the per-sample columns travel with the samples
        i = int(s["sample_id"][1:])
        assert rows[s["sample_id"]] == (SOURCES[i % 3], [], i)
    assert main(argv) == 0
    assert "0 written" in capsys.readouterr().out and len(hsstore.open(dst)) == len(want)
    assert main(["verify", dst, "-q"]) == 0


def test_subset_into_incompatible_store_is_refused(tmp_path, new_manifest, new_samples, write, capsys):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    write(src, new_manifest(), new_samples(5))
    write(dst, new_manifest(layers=(1, 3)), new_samples(2, n_layers=2, prefix="d"))
    assert main(["subset", src, dst, "-q"]) == 2
    assert "layers" in capsys.readouterr().err
    assert committed_ids(dst) == {"d0", "d1"}


def test_subset_splits_by_seeded_fraction_or_id_list_with_the_complement(tmp_path, new_manifest, new_samples, capsys):
    """#53.10: a validation split. --fraction F --seed N takes a seeded share of the conversations the other filters
    keep and --complement the rest: the two share no sample and together hold all, a multi-turn row's samples
    (id#tN) on one side; the same flags choose the same samples again; --ids FILE splits by a list."""
    samples = new_samples(30, min_len=3, max_len=120)
    for k in range(3):  # one conversation's three turns
        samples[k]["sample_id"] = f"conv#t{k}"
    src = str(tmp_path / "src")
    write_tagged(src, new_manifest(), samples, shard_bytes=20_000)
    kept = {s["sample_id"] for s in samples if len(s["input_ids"]) >= 10}
    rows = {sid.split("#")[0] for sid in kept}
    assert {"conv#t0", "conv#t1", "conv#t2"} <= kept and len(rows) >= 20

    def split(dst: str, *flags: str) -> set[str]:
        assert main(["subset", src, str(tmp_path / dst), "--min-length", "10", "-q", *flags]) == 0
        capsys.readouterr()
        return set(hsstore.open(str(tmp_path / dst)).sample_ids())

    val = split("val", "--fraction", "0.25", "--seed", "7")
    rest = split("train", "--fraction", "0.25", "--seed", "7", "--complement")
    assert not val & rest and val | rest == kept
    assert len({sid.split("#")[0] for sid in val}) == round(0.25 * len(rows))
    assert {"conv#t0", "conv#t1", "conv#t2"} <= val or not {"conv#t0", "conv#t1", "conv#t2"} & val
    assert split("val-again", "--fraction", "0.25", "--seed", "7") == val
    assert split("val-seed-8", "--fraction", "0.25", "--seed", "8") != val
    assert_same_samples(str(tmp_path / "val"), [s for s in samples if s["sample_id"] in val])
    assert hsstore.open(str(tmp_path / "train")).manifest.extra["split"] == {"fraction": 0.25, "seed": 7,
                                                                              "complement": True}
    assert main(["subset", src, str(tmp_path / "val"), "--min-length", "10", "--fraction", "0.25", "--seed", "7"]) == 0
    assert f"{len(val)} samples selected (--fraction 0.25 seed 7, of the {len(kept)} samples the filters keep), " \
           f"0 written" in capsys.readouterr().out  # resumed: nothing left to copy

    plain = sorted(kept - {"conv#t0", "conv#t1", "conv#t2"})[0]
    ids = tmp_path / "val-ids.txt"
    ids.write_text(f"conv\n{plain}\n\nnot-a-sample\n")
    listed = split("by-list", "--ids", str(ids))
    assert listed == {"conv#t0", "conv#t1", "conv#t2", plain}
    assert main(["subset", src, str(tmp_path / "by-list-rest"), "--min-length", "10", "--ids", str(ids),
                 "--complement", "-q"]) == 0
    assert "1 of the 3 ids of --ids" in capsys.readouterr().err
    assert set(hsstore.open(str(tmp_path / "by-list-rest")).sample_ids()) == kept - listed

    for flags, said in ((["--complement"], "--complement goes with --fraction F or --ids FILE"),
                        (["--fraction", "1.5"], "a share between 0 and 1"),
                        (["--fraction", "0.001"], "is 0: each side of the split needs at least one"),
                        (["--fraction", "0.5", "--ids", str(ids)], "--fraction or --ids, not both")):
        assert main(["subset", src, str(tmp_path / "never"), "-q", *flags]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and said in err[0], err
    assert not (tmp_path / "never").exists()


# --------------------------------------------------------------------------------------------------- copy
def test_copy_local_to_s3_and_back_is_verified_at_the_end(tmp_path, s3_store, s3_endpoint, new_manifest, new_samples,
                                                          capsys):
    """#53.11: `hsstore copy` moves a store between local disk and S3 (assets included), resumes, and ends with a
    verification of the copy: every byte re-read against the source's commit records (exit 1 when it fails)."""
    from hsstore.format import assets
    from hsstore.io import storage

    url, opts = s3_store
    samples = new_samples(14, min_len=3, max_len=120)
    src, back = str(tmp_path / "src"), str(tmp_path / "back")
    write_tagged(src, new_manifest(), samples, shard_bytes=20_000)
    assets.write_assets(*storage.resolve(src), {assets.CONFIG: b'{"hidden_size": 48}'})
    s3 = ["--dst-storage-option", f"endpoint_url={s3_endpoint}"]
    assert main(["copy", src, url, *s3, "-q"]) == 0
    out = capsys.readouterr().out
    shards = len(hsstore.open(src).commits)
    assert shards > 1 and f"{shards} shards, 14 samples" in out and "verify of the copy: OK" in out
    assert_same_samples(url, samples, opts)
    assert assets.read_asset(*storage.resolve(url, opts), assets.CONFIG) == b'{"hidden_size": 48}'
    assert main(["copy", url, back, "-S", f"endpoint_url={s3_endpoint}", "--json", "-q"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["ok"] and summary["shards"] == shards and summary["verified_shards"] == shards
    assert_same_samples(back, samples)
    assert main(["copy", url, back, "-S", f"endpoint_url={s3_endpoint}", "-q"]) == 0  # resumed: nothing to copy
    assert f"0 shards, 0 samples, 0 bytes copied ({shards} shards already there)" in capsys.readouterr().out

    victim = next(p for p in (tmp_path / "back" / "shards").rglob("c/0/0") if "layer_001" in str(p))
    victim.write_bytes(b"\0" * victim.stat().st_size)  # the copy damaged after the fact: its verification says so
    assert main(["copy", url, back, "-S", f"endpoint_url={s3_endpoint}", "-q"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("FAIL ") and "verify of the copy: FAILED" in out
    other = str(tmp_path / "other")
    write_tagged(other, new_manifest(), new_samples(3, prefix="o"))
    before = sorted(p.name for p in (tmp_path / "back" / "commits").iterdir())
    assert main(["copy", other, back, "-q"]) == 2  # a place holding another store's shards: refused, nothing written
    err = capsys.readouterr().err.strip()
    assert f"holds {shards} shard(s) that {other!r} does not" in err and "hsstore merge" in err
    assert sorted(p.name for p in (tmp_path / "back" / "commits").iterdir()) == before


# -------------------------------------------------------------------------------------------------- merge
@pytest.fixture
def two_stores(tmp_path, new_manifest, new_samples, write):
    a, b = new_samples(12, prefix="a"), new_samples(9, prefix="b", seed=1)
    write(str(tmp_path / "st" / "a"), new_manifest(), a, shard_bytes=30_000)
    write(str(tmp_path / "st" / "b"), new_manifest(), b)
    return str(tmp_path / "st" / "a"), str(tmp_path / "st" / "b"), a + b


def test_merge_by_copy(tmp_path, two_stores, capsys):
    from hsstore.format import assets
    from hsstore.io import storage

    a, b, samples = two_stores
    assets.write_assets(*storage.resolve(a), {assets.CONFIG: b'{"hidden_size": 48}'})  # what a trainer needs
    dst = str(tmp_path / "merged")
    assert main(["merge", dst, a, b, "-q"]) == 0
    assert assets.read_asset(*storage.resolve(dst), assets.CONFIG) == b'{"hidden_size": 48}'
    assert "shards" in capsys.readouterr().out
    assert_same_samples(dst, samples)
    assert main(["verify", dst, "-q"]) == 0
    shards = {c.shard for c in hsstore.open(dst).commits}
    assert all(os.path.isdir(os.path.join(dst, "shards", s)) for s in shards)  # the files are in DST
    assert main(["merge", dst, a, b, "-q"]) == 0  # a re-run finds everything there
    assert "0 shards" in capsys.readouterr().out and len(hsstore.open(dst)) == len(samples)


def test_merge_by_reference_resolves_moves_and_is_verified(tmp_path, two_stores, capsys, monkeypatch):
    monkeypatch.setenv("HSSTORE_ALLOW_LOCATIONS", str(tmp_path))  # dst's shards are read from a and b
    a, b, samples = two_stores
    dst = str(tmp_path / "st" / "ref")
    assert main(["merge", dst, a, b, "--by", "reference", "-q"]) == 0
    assert not os.path.exists(os.path.join(dst, "shards")) or os.listdir(os.path.join(dst, "shards")) == ["zarr.json"]
    rec = json.loads(open(next((tmp_path / "st" / "ref" / "commits").glob("*.json"))).read())
    assert rec["location"] in ("../a", "../b")  # relative: the stores can move together
    assert_same_samples(dst, samples)
    assert main(["verify", dst, "-q"]) == 0
    moved = tmp_path / "elsewhere"
    shutil.move(str(tmp_path / "st"), str(moved))
    assert_same_samples(str(moved / "ref"), samples)
    victim = next(p for p in (moved / "a" / "shards").rglob("c/0/0") if "layer_003" in str(p))
    victim.unlink()
    assert main(["verify", str(moved / "ref"), "-q"]) == 1
    assert "file missing (referenced store '../a')" in capsys.readouterr().out


def test_merge_by_reference_on_s3(s3_store, new_manifest, new_samples, monkeypatch):
    url, opts = s3_store
    base = url.rsplit("/", 1)[0]
    monkeypatch.setenv("HSSTORE_ALLOW_LOCATIONS", base)  # c's shards are read from a and b
    a, b = new_samples(5, prefix="a"), new_samples(4, prefix="b", seed=2)
    write_tagged(f"{base}/a", new_manifest(), a, storage_options=opts)
    write_tagged(f"{base}/b", new_manifest(), b, storage_options=opts)
    from hsstore.ops.merge import merge

    r = merge(f"{base}/c", [f"{base}/a", f"{base}/b"], by="reference", dst_options=opts, progress=False)
    assert r.shards == 2 and r.samples == 9
    assert_same_samples(f"{base}/c", a + b, opts)
    assert json.loads(s3fs_cat(f"{base}/c/commits", opts))["location"] in ("../a", "../b")


def test_merge_by_reference_from_local_into_s3_is_refused(s3_store, tmp_path, new_manifest, new_samples, write):
    from hsstore.ops.merge import merge

    url, opts = s3_store
    write(str(tmp_path / "a"), new_manifest(), new_samples(2))
    with pytest.raises(ValueError, match="would not resolve"):
        merge(url, [str(tmp_path / "a")], by="reference", dst_options=opts, src_options={}, progress=False)


def s3fs_cat(prefix: str, opts) -> bytes:
    """The first object under an S3 prefix."""
    from hsstore.io import storage

    fs, root = storage.resolve(prefix, opts)
    return fs.cat_file(fs.find(root)[0])


@pytest.mark.parametrize("case, message", [
    ("layers", "layers: [1, 3, 5] vs [1, 3]"),
    ("tokenizer", "tokenizer.vocab_hash"),
    ("chunking", "re-encode with `hsstore subset"),
    ("duplicate", "sample id 'a0' is in both"),
])
def test_merge_refusals_write_nothing(tmp_path, new_manifest, new_samples, write, case, message, capsys):
    a = str(tmp_path / "a")
    write(a, new_manifest(), new_samples(4, prefix="a"))
    other = str(tmp_path / "other")
    if case == "layers":
        write(other, new_manifest(layers=(1, 3)), new_samples(3, n_layers=2, prefix="o"))
    elif case == "tokenizer":
        write(other, new_manifest(vocab_hash="vocab-b"), new_samples(3, prefix="o"))
    elif case == "chunking":
        write(other, new_manifest(chunk_tokens=128), new_samples(3, prefix="o"))
    else:
        write(other, new_manifest(), new_samples(3, prefix="a", seed=5))
    dst = tmp_path / "dst"
    for by in ("copy", "reference"):
        assert main(["merge", str(dst), a, other, "--by", by, "-q"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err
        assert not dst.exists()
    write(str(dst), new_manifest(), new_samples(2, prefix="d"))  # an existing destination is left as it was
    assert main(["merge", str(dst), a, other, "-q"]) == 2
    assert committed_ids(str(dst)) == {"d0", "d1"}


def test_merge_refuses_corrupt_source_file_before_its_commit(tmp_path, new_manifest, new_samples, write):
    from hsstore.errors import CorruptionError
    from hsstore.ops.merge import merge

    a = tmp_path / "a"
    write(str(a), new_manifest(), new_samples(4, prefix="a"))
    chunk = next(p for p in (a / "shards").rglob("c/0/0") if "layer_001" in str(p))
    data = bytearray(chunk.read_bytes())
    data[10] ^= 0xFF
    chunk.write_bytes(bytes(data))
    with pytest.raises(CorruptionError, match="layer_001"):
        merge(str(tmp_path / "dst"), [str(a)], progress=False)
    assert committed_ids(str(tmp_path / "dst")) == set()


def test_merge_requires_sources(tmp_path):
    from hsstore.ops.merge import merge

    with pytest.raises(ValueError, match="at least one source"):
        merge(str(tmp_path / "d"), [], progress=False)
    with pytest.raises(ManifestError, match="does not exist"):
        merge(str(tmp_path / "d"), [str(tmp_path / "nothing")], progress=False)
    assert not (tmp_path / "d").exists()


def test_merge_wds_stores_by_reference_and_copy(tmp_path, new_manifest, new_samples, capsys, monkeypatch):
    """Both layouts go through the same reference resolution: tar shards read from where they live."""
    import dataclasses

    monkeypatch.setenv("HSSTORE_ALLOW_LOCATIONS", str(tmp_path))

    m = dataclasses.replace(new_manifest(), layout="wds")
    a, b = new_samples(5, prefix="a"), new_samples(4, prefix="b", seed=2)
    write_tagged(str(tmp_path / "a"), m, a)
    write_tagged(str(tmp_path / "b"), m, b)
    for by in ("reference", "copy"):
        dst = str(tmp_path / by)
        assert main(["merge", dst, str(tmp_path / "a"), str(tmp_path / "b"), "--by", by, "-q"]) == 0
        assert hsstore.open(dst).manifest.layout == "wds"
        assert_same_samples(dst, a + b)
        assert main(["verify", dst, "-q"]) == 0
    (tmp_path / "zarr").mkdir()
    write_tagged(str(tmp_path / "zarr" / "z"), new_manifest(), new_samples(2, prefix="z"))
    assert main(["merge", str(tmp_path / "zarr" / "z"), str(tmp_path / "a"), "-q"]) == 2
    assert "layout" in capsys.readouterr().err
