"""The WebDataset layout's own tests: plain webdataset/numpy readers, convert zarr <-> wds, byte ranges read,
unsafe tar members refused, a truncated tar, extract --layout wds on the tiny target. What every layout
owes (round trips, damage named, the loader's guarantees) is the layout contract (test_layout_contract.py)."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import threading
import re
import tarfile

import numpy as np
import pytest
import torch

import hsstore
from hsstore.format import commit
from hsstore.layouts import wds
from hsstore.app.cli import main
from hsstore.ops.convert import convert
from hsstore.errors import CorruptionError, ManifestError
from hsstore.ops.verify import verify

from conftest import make_manifest, make_samples, write_samples
from test_loader import dataset, ids_of, write_store

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")

SMALL_SHARD = 3 * 48 * 2 * 400  # ~400 tokens per shard: several shards from a few samples


def wds_manifest(**kw):
    return dataclasses.replace(make_manifest(**kw), layout="wds")


def assert_same(store, samples, layers=None):
    by_id = {s["sample_id"]: s for s in samples}
    idx = [store.manifest.layers.index(l) for l in layers] if layers else slice(None)
    assert len(store) == len(samples)
    for i in range(len(store)):
        x = store.read(i, layers=layers)
        want = by_id[x["sample_id"]]
        assert torch.equal(x["input_ids"], want["input_ids"]) and torch.equal(x["loss_mask"], want["loss_mask"])
        assert x["hidden_states"].dtype == want["hidden_states"].dtype
        assert torch.equal(bits_any(x["hidden_states"]), bits_any(want["hidden_states"][:, idx]))


def bits_any(t):
    t = t.contiguous()
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def test_plain_webdataset_and_numpy_read_a_shard(tmp_path):
    import webdataset

    samples = make_samples(6)
    write_samples(str(tmp_path), wds_manifest(), samples)
    store = hsstore.open(str(tmp_path))
    (rec,) = store.commits
    tar = str(tmp_path / "shards" / f"{rec.shard}.tar")
    got = list(webdataset.WebDataset(tar, shardshuffle=False).decode())
    assert [g["json"]["sample_id"] for g in got] == [s["sample_id"] for s in samples]
    for g, s in zip(got, samples):
        assert g["json"]["dtype"] == "bfloat16" and g["json"]["layers"] == [1, 3, 5]
        assert g["input_ids.npy"].dtype == np.int32 and np.array_equal(g["input_ids.npy"], s["input_ids"].numpy())
        assert np.array_equal(g["loss_mask.npy"], s["loss_mask"].numpy().astype(np.uint8))
        for j, l in enumerate((1, 3, 5)):
            a = g[f"layer_{l:03d}.npy"]  # bf16 as its uint16 bits: viewed back, bit-exact
            assert a.dtype == np.uint16
            assert torch.equal(torch.from_numpy(a).view(torch.bfloat16).view(torch.int16),
                               s["hidden_states"][:, j].contiguous().view(torch.int16))
    # tarfile + numpy alone give the same arrays
    with tarfile.open(tar) as tf:
        a = np.load(io.BytesIO(tf.extractfile("000002.layer_005.npy").read()), allow_pickle=False)
    assert np.array_equal(a, got[2]["layer_005.npy"])


def test_convert_zarr_wds_zarr_bit_exact(tmp_path, capsys):
    samples = make_samples(15)
    src = str(tmp_path / "zarr")
    with hsstore.StoreWriter(src, make_manifest(codec="zstd"), shard_bytes=SMALL_SHARD) as w:
        w.note_skipped("over_length", ["long-1"])  # stats travel with the shard
        for x in samples:
            w.add(x["sample_id"], x["input_ids"], x["loss_mask"], x["hidden_states"], source="chat")
    a, b = str(tmp_path / "wds"), str(tmp_path / "back")
    assert main(["convert", src, a, "--layout", "wds", "-q"]) == 0
    assert main(["convert", a, b, "--layout", "zarr", "--codec", "zstd", "-q"]) == 0
    s0, s1, s2 = (hsstore.open(u) for u in (src, a, b))
    assert [m.layout for m in (s0.manifest, s1.manifest, s2.manifest)] == ["zarr", "wds", "zarr"]
    assert s0.manifest.compat_key() == s1.manifest.compat_key() == s2.manifest.compat_key()
    assert s1.manifest.chunk_tokens == s0.manifest.chunk_tokens and s1.manifest.codec == "none"
    for st in (s1, s2):
        assert st.sample_ids() == s0.sample_ids() and [c.shard for c in st.commits] == [c.shard for c in s0.commits]
        assert [c.stats for c in st.commits] == [c.stats for c in s0.commits]
        assert [c.samples for c in st.commits] == [c.samples for c in s0.commits]
        assert_same(st, samples)
        assert verify(st).ok
    assert main(["verify", a, "-q"]) == 0 and main(["verify", b, "-q"]) == 0
    # a re-run resumes: nothing left to do
    capsys.readouterr()
    assert main(["convert", src, a, "--layout", "wds", "-q"]) == 0
    assert f"0 shards, 0 samples written; {len(s0.commits)} shards already there" in capsys.readouterr().out
    # a destination of another layout, of another model, or the source itself is refused
    assert main(["convert", src, a, "--layout", "zarr", "-q"]) == 2
    assert "exists with layout 'wds'" in capsys.readouterr().err
    other = str(tmp_path / "other")
    write_samples(other, wds_manifest(config_hash="cfg-other"), make_samples(2, prefix="o"))
    with pytest.raises(ManifestError, match="incompatible.*config_hash"):
        convert(src, other, "wds")
    assert main(["convert", src, src, "--layout", "wds", "-q"]) == 2
    assert "same store" in capsys.readouterr().err


@pytest.fixture(scope="module")
def loader_samples():
    return make_samples(40, max_len=120)


def member_spans(store, keep):
    """(tar file name, start, end) of member data, for members whose name ``keep`` accepts."""
    return [(f"{c.shard}.tar", o, o + n) for c in store.commits for k, (o, n, _) in c.members.items() if keep(k)]


def overlaps(ranges, spans):
    return [(r, s) for r in ranges for s in spans if r[0] == s[0] and r[1] < s[2] and s[1] < r[2]]


def test_only_requested_layers_bytes_read_local(tmp_path, loader_samples, monkeypatch):
    url = write_store(str(tmp_path / "s"), loader_samples, manifest=wds_manifest(), shard_tokens=600)
    store = hsstore.open(url)
    read, tar = [], threading.local()
    real, real_local = wds._read_at, wds._read_local

    def spy(src, offset, buf, crc=None):
        read.append((tar.name, offset, offset + buf.nbytes))
        return real(src, offset, buf, crc)

    def spy_local(root, rec, jobs):  # which tar this thread's reads that follow are of
        tar.name = f"{rec.shard}.tar"
        return real_local(root, rec, jobs)

    monkeypatch.setattr(wds, "_read_at", spy)
    monkeypatch.setattr(wds, "_read_local", spy_local)
    assert len(ids_of(dataset(url, layers=[3]))) == len(loader_samples)
    others = member_spans(store, lambda k: ".layer_001." in k or ".layer_005." in k)
    assert read and not overlaps(read, others)
    # exactly the wanted members and their tar headers (checked on every read)
    wanted = member_spans(store, lambda k: k.endswith((".layer_003.npy", ".input_ids.npy", ".loss_mask.npy")))
    assert sum(e - s for _, s, e in read) == sum(512 + e - s for _, s, e in wanted)


def test_only_requested_layers_bytes_read_s3(s3_store, loader_samples, monkeypatch):
    from hsstore.io import receive

    url, opts = s3_store
    write_store(url, loader_samples[:20], manifest=wds_manifest(), shard_tokens=600, storage_options=opts)
    store = hsstore.open(url, **opts)
    ranges = []
    orig = receive.s3_get  # every ranged GET of an S3 object's bytes (the bounded receive path)

    async def spy(fs, path, start, end):
        data = await orig(fs, path, start, end)
        if path.endswith(".tar"):
            ranges.append((path.rsplit("/", 1)[-1], start, start + len(data)))
        return data

    monkeypatch.setattr(receive, "s3_get", spy)
    got = list(dataset(url, layers=[3], storage_options=opts))
    assert len(got) == 20
    others = member_spans(store, lambda k: ".layer_001." in k or ".layer_005." in k)
    assert ranges and not overlaps(ranges, others)
    wanted = sum(512 + e - s for _, s, e in member_spans(
        store, lambda k: k.endswith((".layer_003.npy", ".input_ids.npy", ".loss_mask.npy"))))
    assert wanted <= sum(e - s for _, s, e in ranges) <= wanted * 1.5
    # neighbouring members are fetched together: ids + mask in one request, the layer in another
    assert len(ranges) == 2 * 20
    ranges.clear()
    assert len(list(dataset(url, storage_options=opts))) == 20  # all layers: whole runs of samples at once
    assert len(ranges) < 20


def craft(store, shard_index, member, how):
    """Rewrite one member's tar header (a path outside the shard, an absolute path, a symlink), fixing the
    tar's size/CRC32C in the commit record so that only the member itself is wrong."""
    rec = store.commits[shard_index]
    path = os.path.join(store.root, wds.tar_path(rec.shard))
    data = bytearray(open(path, "rb").read())
    hdr = rec.members[member][0] - 512
    info = tarfile.TarInfo.frombuf(bytes(data[hdr:hdr + 512]), "utf-8", "surrogateescape")
    if how == "dotdot":
        info.name = "../evil.npy"
    elif how == "absolute":
        info.name = "/tmp/evil.npy"
    elif how == "renamed":
        info.name = "000000.layer_009.npy"
    else:
        info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
    data[hdr:hdr + 512] = info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "surrogateescape")
    open(path, "wb").write(bytes(data))
    rec.files[wds.tar_path(rec.shard)]["crc32c"] = hsstore.format.codec.crc32c(bytes(data))
    commit.publish(store.fs, store.root, rec)
    return rec


@pytest.mark.parametrize("how,expect", [("dotdot", r"member '\.\./evil\.npy': path outside the shard"),
                                        ("absolute", r"member '/tmp/evil\.npy': path outside the shard"),
                                        ("symlink", r"member '000000\.layer_003\.npy': symlink member refused"),
                                        ("renamed", r"member '000000\.layer_009\.npy' \(\d+ bytes\) found where "
                                                    r"the commit record puts member '000000\.layer_003\.npy'")])
def test_unsafe_tar_member_refused_nothing_half_written(tmp_path, how, expect, capsys):
    src = str(tmp_path / "src")
    samples = make_samples(12)
    write_samples(src, wds_manifest(), samples, shard_bytes=SMALL_SHARD)
    rec = craft(hsstore.open(src), 1, "000000.layer_003.npy", how)
    store = hsstore.open(src)
    with pytest.raises(CorruptionError, match=rf"shard '{rec.shard}', {expect}"):
        store.read(store.commits[0].n_samples)
    assert len(ids_of(dataset(src, layers=[1]))) == len(samples)  # other members still read
    report = verify(store)
    assert not report.ok and any(rec.shard == p.shard and ("refused" in p.message or "not in the commit record"
                                                           in p.message) for p in report.problems)
    # convert stops at the bad shard: earlier shards committed, nothing of the bad one written
    dst = str(tmp_path / "dst")
    capsys.readouterr()
    assert main(["convert", src, dst, "--layout", "zarr", "-q"]) == 2
    err = capsys.readouterr().err
    assert re.search(rf"shard '{rec.shard}', {expect}", err) and len(err.strip().splitlines()) == 1
    committed = commit.list_committed(*hsstore.io.storage.resolve(dst))
    assert committed == [store.commits[0].shard]
    assert not os.path.exists(os.path.join(dst, "shards", rec.shard))
    assert not any(f.startswith(".") for f in os.listdir(os.path.join(dst, "commits")))
    assert not os.path.exists(tmp_path / "evil.npy") and not os.path.exists("/tmp/evil.npy")


def test_manifest_rules_and_zarr_records_unchanged(tmp_path):
    with pytest.raises(ManifestError, match="codec must be 'none'"):
        wds_manifest(codec="zstd")
    write_samples(str(tmp_path), make_manifest(), make_samples(3))
    store = hsstore.open(str(tmp_path))
    raw = json.loads(open(os.path.join(str(tmp_path), commit.commit_path(store.commits[0].shard))).read())
    assert "members" not in raw  # hsstore 0.1 readers still read zarr stores written now


def test_extract_layout_wds_tiny_target(tiny_dir, tok, tmp_path):
    from hsstore.extract.tiny import demo_conversations_path
    from hsstore.extract.tokenize import load_samples

    lines = demo_conversations_path().read_text().splitlines()[:4]
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    out = str(tmp_path / "store")
    assert main(["extract", "--model", str(tiny_dir), "--input", str(inp), "--out", out, "--layout", "wds",
                 "--device", "cpu", "--layers", "1,4", "-q"]) == 0
    store = hsstore.open(out)
    assert store.manifest.layout == "wds" and store.manifest.layers == (1, 4)
    want = {s.sample_id: s for s in load_samples(inp, tok)}
    assert sorted(store.sample_ids()) == sorted(want)
    for i in range(len(store)):
        x = store.read(i)
        assert x["input_ids"].tolist() == want[x["sample_id"]].input_ids.tolist()
        assert x["hidden_states"].shape == (len(x["input_ids"]), 2, store.manifest.hidden_size)
        assert x["hidden_states"].dtype == torch.bfloat16 and torch.isfinite(x["hidden_states"].float()).all()
    assert verify(store).ok
    assert all(f.endswith(".tar") for f in os.listdir(os.path.join(out, "shards")))
    # a store of the tiny model refuses a conversion of another model's store into it
    other = str(tmp_path / "other")
    write_samples(other, make_manifest(), make_samples(2))
    with pytest.raises(ManifestError, match="incompatible"):
        convert(other, out, "wds")


def test_truncated_or_missing_tar_named(tmp_path):
    write_samples(str(tmp_path), wds_manifest(), make_samples(8), shard_bytes=SMALL_SHARD)
    store = hsstore.open(str(tmp_path))
    rec = store.commits[0]
    path = os.path.join(str(tmp_path), wds.tar_path(rec.shard))
    os.truncate(path, rec.members[f"{wds.sample_key(rec.n_samples - 1)}.layer_005.npy"][0] + 10)
    with pytest.raises(CorruptionError, match=rf"shard '{rec.shard}', member '.*layer_005\.npy': truncated tar"):
        store.read(rec.n_samples - 1)
    assert store.read(0)["sample_id"] == "s0"  # samples before the cut still read
    assert any("truncated" in p.message or "unreadable" in p.message for p in verify(store).problems)
    os.remove(path)
    with pytest.raises(CorruptionError, match=rf"shard '{rec.shard}', file shards/{rec.shard}\.tar: missing"):
        store.read(0)
