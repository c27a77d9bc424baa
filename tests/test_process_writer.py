"""ProcessWriter: the StoreWriter in a child process, fed through shared-memory staging buffers."""

import os
import signal

import pytest
import torch

import hsstore
from hsstore import ProcessWriter
from hsstore.ops.verify import verify


def _stage(w: ProcessWriter, samples, nbytes: int):
    """Copy samples' features into one staging buffer, as extraction does; -> views into it."""
    buf = w.staging(nbytes)
    views, off = [], 0
    for s in samples:
        hs = s["hidden_states"]
        n = hs.numel() * hs.element_size()
        v = buf[off:off + n].view(hs.dtype).view(hs.shape)
        v.copy_(hs)
        views.append(v)
        off += n
    return views


def test_same_store_as_the_in_process_writer(tmp_path, new_manifest, new_samples, write):
    manifest = new_manifest()
    samples = new_samples(30)
    write(str(tmp_path / "thread"), manifest, samples, shard_bytes=40_000)
    url = str(tmp_path / "proc")
    with ProcessWriter(url, manifest, shard_bytes=40_000) as w:
        views = _stage(w, samples, 4 << 20)
        for s, v in zip(samples, views):
            w.add(s["sample_id"], s["input_ids"], s["loss_mask"], v, source="src")
        w.sync()
        for v in views:  # after sync the child holds its own copy: the staging area may be reused
            v.fill_(0)
        w.note_skipped("over_length", ["x1"])
    a, b = hsstore.open(str(tmp_path / "thread")), hsstore.open(url)
    assert len(b) == len(samples) and len(b.commits) > 1 and w.committed_shards == len(b.commits)
    assert w.bytes_written > 0
    for i in range(len(a)):
        x, y = a.read(i), b.read(i)
        assert x["sample_id"] == y["sample_id"]
        assert torch.equal(x["hidden_states"].view(torch.int16), y["hidden_states"].view(torch.int16))
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"])
    assert verify(b).ok
    assert any(c.stats.get("skipped") == {"over_length": ["x1"]} for c in b.commits)


def test_a_bad_sample_is_reported_and_nothing_of_its_shard_committed(tmp_path, new_manifest, new_samples):
    manifest = new_manifest()
    samples = new_samples(3)
    url = str(tmp_path / "s")
    with pytest.raises(hsstore.SampleError, match=r"sample 's1': loss_mask has"):
        with ProcessWriter(url, manifest) as w:
            views = _stage(w, samples, 1 << 20)
            w.add("s0", samples[0]["input_ids"], samples[0]["loss_mask"], views[0])
            w.add("s1", samples[1]["input_ids"], samples[1]["loss_mask"][:-1], views[1])
            w.sync()
    assert len(hsstore.open(url)) == 0


def test_features_outside_the_staging_buffers_are_refused(tmp_path, new_manifest, new_samples):
    s = new_samples(1)[0]
    with ProcessWriter(str(tmp_path / "s"), new_manifest()) as w:
        with pytest.raises(hsstore.SampleError, match="not in a staging buffer"):
            w.add("s0", s["input_ids"], s["loss_mask"], s["hidden_states"])


def test_a_dead_writer_process_is_a_clear_error(tmp_path, new_manifest, new_samples):
    samples = new_samples(2)
    url = str(tmp_path / "s")
    w = ProcessWriter(url, new_manifest())
    views = _stage(w, samples, 1 << 20)
    os.kill(w._proc.pid, signal.SIGKILL)
    w._proc.join()
    with pytest.raises(hsstore.StoreError, match="writer process of store .* died"):
        for s, v in zip(samples, views):
            w.add(s["sample_id"], s["input_ids"], s["loss_mask"], v)
        w.sync()
    w.close(commit=False)
    assert len(hsstore.open(url)) == 0


def test_a_store_of_another_identity_is_refused_at_start(tmp_path, new_manifest, write, new_samples):
    url = str(tmp_path / "s")
    write(url, new_manifest(), new_samples(2))
    with pytest.raises(hsstore.ManifestError):
        ProcessWriter(url, new_manifest(config_hash="other"))


def test_process_writer_on_s3(s3_store, new_manifest, new_samples):
    """The child reaches the object store with the parent's storage options (and environment)."""
    url, opts = s3_store
    samples = new_samples(6)
    with ProcessWriter(url, new_manifest(), storage_options=opts, shard_bytes=20_000) as w:
        views = _stage(w, samples, 1 << 20)
        for s, v in zip(samples, views):
            w.add(s["sample_id"], s["input_ids"], s["loss_mask"], v)
    store = hsstore.open(url, **opts)
    assert sorted(store.sample_ids()) == sorted(s["sample_id"] for s in samples) and len(store.commits) > 1
    for i in range(len(store)):
        got = store.read(i)
        want = next(s for s in samples if s["sample_id"] == got["sample_id"])
        assert torch.equal(got["hidden_states"].view(torch.int16), want["hidden_states"].view(torch.int16))
    assert verify(store).ok
