"""The zarr layout's own round-trip tests (only the layer's chunk files opened, zarr-python reads the shards),
S3 from the AWS environment, two writers on S3, CRC32C backends, forks. Round trips every layout owes are
the layout contract (test_layout_contract.py)."""

import gc
import os

import numpy as np
import pytest
import torch
import zarr

import hsstore


def assert_same(store, samples, layers=None):
    by_id = {s["sample_id"]: s for s in samples}
    seen = []
    for i in range(len(store)):
        got = store.read(i, layers=layers)
        want = by_id[got["sample_id"]]
        hs = want["hidden_states"]
        if layers is not None:
            hs = hs[:, [store.layers.index(l) for l in layers]]
        assert torch.equal(got["input_ids"], want["input_ids"])
        assert torch.equal(got["loss_mask"], want["loss_mask"])
        assert got["hidden_states"].dtype == hs.dtype
        assert got["hidden_states"].shape == hs.shape
        # bit-exact: compare the raw bits, not values (NaN-safe, -0.0-safe)
        assert torch.equal(got["hidden_states"].contiguous().view(torch.int16 if hs.element_size() == 2 else torch.int32),
                           hs.contiguous().view(torch.int16 if hs.element_size() == 2 else torch.int32))
        seen.append(got["sample_id"])
    assert sorted(seen) == sorted(by_id)


def test_layer_subset_reads_only_that_layer(tmp_path, new_manifest, samples, write):
    write(str(tmp_path), new_manifest(), samples)
    store = hsstore.open(str(tmp_path))
    assert_same(store, samples, layers=[3])
    assert_same(store, samples, layers=[1, 5])
    # only layer_003 chunk files are opened for a layer-3 read (every read goes through the door)
    from hsstore.io import door

    opened = []
    real_open = door.open_beneath

    def spy(root, key, *a, **k):
        opened.append(f"{root}/{key}")
        return real_open(root, key, *a, **k)

    door.open_beneath = spy
    try:
        store.read(0, layers=[3])
    finally:
        door.open_beneath = real_open
    feature_files = [p for p in opened if "/layer_" in p]
    assert feature_files and all("/layer_003/" in p for p in feature_files)
    with pytest.raises(hsstore.StoreError, match=r"layers \[7\] are not in store"):
        store.read(0, layers=[7])


def test_zarr_python_reads_the_shards(tmp_path, new_manifest, samples, write):
    """The shards are plain Zarr v3: zarr-python reads features, ids and offsets without hsstore."""
    write(str(tmp_path), new_manifest(codec="zstd", chunk_tokens=40), samples)
    store = hsstore.open(str(tmp_path))
    rec = store.commits[0]
    g = zarr.open_group(str(tmp_path / "shards" / rec.shard), mode="r")
    np.testing.assert_array_equal(g["offsets"][:], rec.offsets)
    first = store.read(0)
    T = first["input_ids"].shape[0]
    np.testing.assert_array_equal(g["input_ids"][:T], first["input_ids"].numpy())
    bits = g["layer_005"][:T]
    assert g["layer_005"].attrs["hsstore_dtype"] == "bfloat16"
    np.testing.assert_array_equal(bits, first["hidden_states"][:, 2].contiguous().view(torch.uint16).numpy())


def test_s3_endpoint_from_aws_env(s3_store, new_manifest, new_samples, write, monkeypatch):
    """No storage options at all: botocore's AWS_ENDPOINT_URL is honoured."""
    url, opts = s3_store
    monkeypatch.setenv("AWS_ENDPOINT_URL", opts["endpoint_url"])
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    samples = new_samples(4)
    write(url, new_manifest(), samples)
    assert_same(hsstore.open(url), samples)


def test_two_writers_on_s3(s3_store, new_manifest, new_samples, write):
    url, opts = s3_store
    a, b = new_samples(6, prefix="a", seed=3), new_samples(6, prefix="b", seed=4)
    m = new_manifest()
    write(url, m, a, storage_options=opts, writer_tag="rank0")
    write(url, m, b, storage_options=opts, writer_tag="rank0")  # same tag, new session: no overwrite
    store = hsstore.open(url, **opts)
    assert sorted(store.sample_ids()) == sorted(s["sample_id"] for s in a + b)


@pytest.mark.parametrize("backend", ["crc32c", "google_crc32c"])
def test_crc32c_backends_agree(backend, monkeypatch, tmp_path):
    """The GIL-releasing ``crc32c`` package and the google_crc32c fallback give the CRC32C that Zarr's codec
    writes, for every kind of buffer the readers pass (arrays of any dtype, strided views, bytes, mmaps),
    whole or in parts."""
    import mmap

    import google_crc32c  # what zarr-python's crc32c codec computes

    from hsstore.format import codec

    if backend == "google_crc32c":
        monkeypatch.setattr(codec, "_crc32c_nogil", None)
    elif codec._crc32c_nogil is None:
        pytest.skip("the crc32c package is not installed")
    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 2**16, (37, 129), dtype=np.uint16), rng.random((5, 7)) > 0.5,
              rng.integers(0, 2**16, (64, 64), dtype=np.uint16)[:, ::2], np.zeros(0, np.uint8),
              torch.randn(100, 33).to(torch.bfloat16).view(torch.int16).numpy()]
    for a in arrays:
        assert codec.crc32c(a) == google_crc32c.value(np.ascontiguousarray(a).tobytes())
    blob = rng.integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
    want = google_crc32c.value(blob)
    assert codec.crc32c(blob) == codec.crc32c(bytearray(blob)) == codec.crc32c(memoryview(blob)) == want
    assert codec.crc32c(blob[777:], codec.crc32c(blob[:777])) == want
    (tmp_path / "f").write_bytes(blob)
    with open(tmp_path / "f", "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        assert codec.crc32c(m) == want
        assert codec.crc32c(memoryview(m)[10:5000]) == google_crc32c.value(blob[10:5000])


def _fork_freeze_counts() -> tuple[int, int]:
    """gc.get_freeze_count() in a forked child and, after the fork, in the parent."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover  (child)
        os.write(w, str(gc.get_freeze_count()).encode())
        os._exit(0)
    os.close(w)
    child = int(os.read(r, 32))
    os.close(r)
    os.waitpid(pid, 0)
    return child, gc.get_freeze_count()


def test_fork_keeps_an_applications_gc_freeze(tmp_path, new_manifest, new_samples, write):
    """The reader's fork hook freezes the collector across a fork (so a child never finalises the parent's
    filesystems); an application's own ``gc.freeze()`` before forking (Python's advice for fork without
    exec) must stay in force in the parent and the child, and without one the parent is thawed again."""
    write(str(tmp_path), new_manifest(), new_samples(3))
    store = hsstore.open(str(tmp_path))  # registers the hook, caches a filesystem
    store.read(0)
    assert gc.get_freeze_count() == 0, "another test left the collector frozen"
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 0
        child, parent = _fork_freeze_counts()
        # objects freed meanwhile leave the count (in the child and the parent); thawed, it would be 0
        assert child > frozen // 2 and parent > frozen // 2, (child, parent, frozen)
    finally:
        gc.unfreeze()
    child, parent = _fork_freeze_counts()
    assert child > 0 and parent == 0



@pytest.mark.parametrize("path", ["preadv", "preadv-small-blocks"])
def test_partial_chunks_read_straight_into_the_output_and_checked_whole(tmp_path, path, monkeypatch):
    """Every token range of a shard (starts and stops inside chunks: the rows wanted land in the output, the
    others in scratch) reads back bit-exact on each local read path, and a byte flipped in rows the range does
    not take is still a CorruptionError: the whole chunk is checked."""
    from hsstore.io import memory
    from hsstore.testing.stores import make_manifest, make_samples, write_store

    if path == "preadv-small-blocks":
        monkeypatch.setattr(memory, "READ_BLOCK", 1000)  # blocks that straddle the parts
    samples = make_samples(6, max_len=90, min_len=40)
    url = write_store(str(tmp_path / "s"), samples, manifest=make_manifest(chunk_tokens=16), shard_tokens=10_000)
    store = hsstore.open(url)
    (rec,) = store.commits
    whole_ids, whole_mask, whole = store.read_range(rec.shard, 0, rec.n_tokens)
    want = np.concatenate([s["hidden_states"].permute(1, 0, 2).view(torch.int16).numpy() for s in samples], axis=1)
    assert np.array_equal(whole.view(np.int16), want)
    for start, stop in [(3, 13), (5, 16), (16, 40), (7, 50), (33, 34), (1, rec.n_tokens - 1)]:
        ids, mask, feats = store.read_range(rec.shard, start, stop)
        assert np.array_equal(ids, whole_ids[start:stop]) and np.array_equal(mask, whole_mask[start:stop])
        assert np.array_equal(feats.view(np.int16), want[:, start:stop])
    key = next(k for k in rec.files if "/layer_" in k and k.endswith("/c/1/0"))  # tokens 16..31
    path_of = os.path.join(store.root, key)
    data = bytearray(open(path_of, "rb").read())
    data[2 * 48 * 2] ^= 0x01  # token 18: outside 20..30
    open(path_of, "wb").write(bytes(data))
    with pytest.raises(hsstore.CorruptionError, match=r"c/1/0"):
        store.read_range(rec.shard, 20, 30)
