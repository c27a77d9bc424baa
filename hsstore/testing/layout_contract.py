"""The behaviour every shard layout owes (``hsstore.layouts.base.Layout``), as one base class of tests.

A layout's test class subclasses :class:`LayoutContract`, names its layout, lists the manifest variants worth
running (``variants``) and says where one feature byte of a sample lies on disk (``feature_byte``); it then
gets every test below (the pattern of zarr-python's store test base class: one subclass per backend).
hsstore's own subclasses are in tests/test_layout_contract.py, which refuses a registered layout without one; a
layout outside the package subclasses it the same way in its own tests.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import shutil
import threading

import numpy as np
import pytest
import torch

from ..app.cli import main
from ..errors import CorruptionError, StoreError
from ..format import commit
from ..layouts import base as layout
from ..ops.verify import verify
from ..store import reader
from ..store.writer import StoreWriter
from .loading import StatefulDataLoader, collect, dataset, ids_of
from .stores import TOKEN_BYTES, make_manifest, make_samples, write_samples, write_store

SMALL_SHARD = TOKEN_BYTES * 400  # ~400 tokens per shard: several shards from a few samples
DTYPES = [(torch.bfloat16, "bfloat16"), (torch.float16, "float16"), (torch.float32, "float32")]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits (bit-exact comparisons: NaN-safe, -0.0-safe)."""
    t = t.contiguous()
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def assert_same(store, samples, layers=None):
    """Every sample of ``store`` is one of ``samples``, ids, mask and features bit-exact, each once."""
    by_id = {s["sample_id"]: s for s in samples}
    idx = [store.manifest.layers.index(l) for l in layers] if layers else slice(None)
    seen = []
    for i in range(len(store)):
        x = store.read(i, layers=layers)
        want = by_id[x["sample_id"]]
        assert torch.equal(x["input_ids"], want["input_ids"]) and x["input_ids"].dtype == torch.int64
        assert torch.equal(x["loss_mask"], want["loss_mask"]) and x["loss_mask"].dtype == torch.bool
        hs = want["hidden_states"][:, idx]
        assert x["hidden_states"].dtype == hs.dtype and x["hidden_states"].shape == hs.shape
        assert torch.equal(bits(x["hidden_states"]), bits(hs))
        seen.append(x["sample_id"])
    assert sorted(seen) == sorted(by_id)


def assert_masks_whole(store, samples) -> None:
    """Each shard's loss_mask read whole by the layout (``read_loss_mask``) is its samples' written masks."""
    by_id = {s["sample_id"]: s for s in samples}
    for rec in store.commits:
        got = layout.get(store.manifest.layout).read_loss_mask(store.source, rec)
        want = torch.cat([by_id[sid]["loss_mask"] for sid in rec.samples["sample_id"]]).numpy()
        assert got.dtype == np.uint8 and np.array_equal(got, want.astype(np.uint8)), rec.shard


class LayoutContract:
    """Tests every layout passes. Subclasses set ``layout`` and may set ``variants`` (manifest keyword sets,
    each a run of the tests that take ``variant``) and must implement ``feature_byte``."""

    layout: str = ""
    variants: list[dict] = [{}]

    def pytest_generate_tests(self, metafunc) -> None:
        """Each test that takes ``variant`` runs once per manifest variant the subclass lists (pytest calls a
        test class's own hook)."""
        if "variant" in metafunc.fixturenames:
            metafunc.parametrize("variant", self.variants,
                                 ids=[",".join(f"{k}={v}" for k, v in v.items()) or "default" for v in self.variants])

    # -- what a subclass provides -------------------------------------------------------------------
    def feature_byte(self, store, shard_index: int, local: int, layer: int) -> tuple[str, int, str, list[str]]:
        """(local file path, byte offset, the file's or member's name as errors give it, sample ids whose
        features that byte belongs to) for a byte of sample ``local``'s ``layer`` features in shard
        ``shard_index`` of a local store."""
        raise NotImplementedError

    # -- helpers -----------------------------------------------------------------------------------
    def manifest(self, variant: dict | None = None, **kw):
        return dataclasses.replace(make_manifest(**{**(variant or {}), **kw}), layout=self.layout)

    def loader_store(self, url: str, samples, **kw) -> str:
        return write_store(url, samples, manifest=self.manifest(chunk_tokens=64), shard_tokens=600, **kw)

    # -- writing and reading back ---------------------------------------------------------------------
    @pytest.mark.parametrize("dtype,name", DTYPES, ids=[n for _, n in DTYPES])
    def test_round_trip_bit_exact(self, tmp_path, variant, dtype, name):
        samples = make_samples(12, dtype=dtype)
        url = str(tmp_path)
        write_samples(url, self.manifest(variant, dtype=name, chunk_tokens=50), samples,
                      shard_bytes=SMALL_SHARD * dtype.itemsize // 2)
        store = reader.open(url)
        assert store.manifest.layout == self.layout and len(store.commits) > 2
        assert_same(store, samples)
        assert_same(store, samples, layers=[5, 1])  # a subset, in the order asked
        assert [x["sample_id"] for x in store] == [store.ref(i).sample_id for i in range(len(store))]
        with pytest.raises(StoreError, match=r"layers \[7\] are not in store"):
            store.read(0, layers=[7])
        assert verify(store).ok

    def test_read_range_across_samples_and_chunks(self, tmp_path):
        samples = make_samples(12)
        write_samples(str(tmp_path), self.manifest(chunk_tokens=50), samples, shard_bytes=SMALL_SHARD)
        store = reader.open(str(tmp_path))
        rec = store.commits[0]
        assert rec.n_samples > 2 and rec.n_tokens > 2 * 50
        tokens = slice(3, rec.n_tokens - 2)  # starts and stops inside samples, crosses chunk boundaries
        want = samples[:rec.n_samples]
        ids, mask, feats = store.read_range(rec.shard, tokens.start, tokens.stop, layers=[5, 3])
        assert np.array_equal(ids, torch.cat([s["input_ids"] for s in want])[tokens].numpy())
        assert np.array_equal(mask, torch.cat([s["loss_mask"] for s in want])[tokens].numpy())
        for j, col in enumerate((2, 1)):
            flat = torch.cat([s["hidden_states"][:, col] for s in want])[tokens]
            assert feats[j].dtype.itemsize == 2 and np.array_equal(feats[j], bits(flat).numpy().view(feats.dtype))
        ids, mask, feats = store.read_range(rec.shard, 7, 7, layers=[1])
        assert ids.shape == (0,) and feats.shape == (1, 0, 48)
        with pytest.raises(CorruptionError, match=rf"shard '{rec.shard}': tokens 0:{rec.n_tokens + 1} outside"):
            store.read_range(rec.shard, 0, rec.n_tokens + 1)

    def test_s3_round_trip_and_verify(self, s3_store):
        url, opts = s3_store
        samples = make_samples(10)
        write_samples(url, self.manifest(chunk_tokens=50), samples, shard_bytes=SMALL_SHARD, storage_options=opts)
        store = reader.open(url, **opts)
        assert len(store.commits) > 1
        assert_same(store, samples)
        assert_same(store, samples, layers=[3])
        assert_masks_whole(store, samples)
        assert verify(store).ok

    def test_loss_mask_read_whole_is_the_written_one(self, tmp_path):
        """``read_loss_mask``: a shard's loss_mask whole, bit-exact, chunk and sample boundaries inside it."""
        samples = make_samples(12)
        write_samples(str(tmp_path), self.manifest(chunk_tokens=50), samples, shard_bytes=SMALL_SHARD)
        store = reader.open(str(tmp_path))
        assert len(store.commits) > 1 and store.commits[0].n_tokens > 2 * 50
        assert_masks_whole(store, samples)

    def test_two_writers_one_store(self, tmp_path):
        """Two concurrent writers add to one store: nothing overwritten, every sample there once."""
        a, b = make_samples(15, prefix="a", seed=1), make_samples(15, prefix="b", seed=2)
        m = self.manifest()
        threads = [threading.Thread(target=write_samples, args=(str(tmp_path), m, s),
                                    kwargs={"shard_bytes": SMALL_SHARD}) for s in (a, b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        store = reader.open(str(tmp_path))
        assert sorted(store.sample_ids()) == sorted(s["sample_id"] for s in a + b)
        assert len({c.shard for c in store.commits}) == len(store.commits)
        assert_same(store, a + b)

    def test_sample_larger_than_a_shard(self, tmp_path):
        """A sample larger than a shard gets a shard of its own; everything else still round-trips."""
        samples = make_samples(4, min_len=10, max_len=20) + make_samples(1, min_len=900, max_len=901, prefix="big")
        w = write_samples(str(tmp_path), self.manifest(), samples, shard_bytes=TOKEN_BYTES * 100, max_pending=1)
        assert len(w.committed) >= 2
        store = reader.open(str(tmp_path))
        assert any(c.samples["sample_id"] == ["big0"] for c in store.commits)
        assert_same(store, samples)

    # -- commit visibility ----------------------------------------------------------------------------
    def test_uncommitted_shard_invisible(self, tmp_path, capsys):
        url = str(tmp_path)
        m = self.manifest()
        write_samples(url, m, make_samples(5, prefix="done"))
        with pytest.raises(RuntimeError):  # a writer that dies mid-way: its buffered shard is not committed
            with StoreWriter(url, m) as w:
                for s in make_samples(5, prefix="lost", seed=9):
                    w.add(s["sample_id"], s["input_ids"], s["loss_mask"], s["hidden_states"])
                raise RuntimeError("crash")
        w = StoreWriter(url, m)  # a shard whose files are written, its record not (crash between)
        for s in make_samples(3, prefix="orphan", seed=7):
            w.add(s["sample_id"], s["input_ids"], s["loss_mask"], s["hidden_states"])
        real_publish = commit.publish
        commit.publish = lambda *a, **k: None
        try:
            w.close()
        finally:
            commit.publish = real_publish
        on_disk = {layout.get(self.layout).shard_of(e) for e in os.listdir(tmp_path / "shards")} - {None}
        assert len(on_disk) == 2  # both shards' files are on disk
        store = reader.open(url)
        assert sorted(store.sample_ids()) == [f"done{i}" for i in range(5)]
        report = verify(store)
        assert report.ok and len(report.uncommitted) == 1
        capsys.readouterr()
        assert main(["info", url, "--json"]) == 0
        info = json.loads(capsys.readouterr().out)
        assert info["layout"] == self.layout and info["samples"] == 5

    # -- damage is found and named ------------------------------------------------------------------
    def test_flipped_feature_byte_detected_and_named(self, tmp_path):
        samples = make_samples(40, max_len=120)
        url = self.loader_store(str(tmp_path / "s"), samples)
        store = reader.open(url)
        rec = store.commits[1]
        path, offset, name, hit = self.feature_byte(store, 1, 1, 5)
        assert rec.samples["sample_id"][1] in hit
        data = bytearray(open(path, "rb").read())
        data[offset] ^= 0xFF
        open(path, "wb").write(bytes(data))
        with pytest.raises(CorruptionError, match=rf"shard '{rec.shard}', .*{name}.*checksum"):
            reader.open(url).read(store.commits[0].n_samples + 1)
        with pytest.raises(CorruptionError, match=rf"shard '{rec.shard}', sample '({'|'.join(hit)})'.*checksum"):
            list(dataset(url))
        ds = dataset(url, skip_corrupt=True)
        assert sorted(ids_of(ds)) == sorted({s["sample_id"] for s in samples} - set(hit))
        assert sum(ds.state_dict()["skipped"].values()) == len(hit)
        assert len(ids_of(dataset(url, layers=[1, 3]))) == len(samples)  # other layers untouched
        report = verify(reader.open(url))
        assert not report.ok and any(name in str(p) and set(hit) & set(p.samples) for p in report.problems)

    def test_local_reads_give_the_written_bits_and_name_damage(self, tmp_path):
        """Local reads go by ``preadv`` into the destination, checked block by block: the written bits through
        ``read`` and the loader, and a feature file cut short is one ``CorruptionError`` naming the shard."""
        samples = make_samples(24, max_len=150)
        url = self.loader_store(str(tmp_path / "s"), samples)
        store = reader.open(url)
        assert len(store.commits) > 1
        assert_same(store, samples)
        by_id = {s["sample_id"]: s for s in samples}
        got = {item["sample_id"]: item for item in dataset(url)}
        assert sorted(got) == sorted(by_id)
        for sid, item in got.items():
            assert torch.equal(bits(item["hidden_states"]), bits(by_id[sid]["hidden_states"]))
            assert torch.equal(item["input_ids"], by_id[sid]["input_ids"])
        rec = store.commits[1]
        path, offset, _, _ = self.feature_byte(store, 1, 1, 5)
        os.truncate(path, offset)
        with pytest.raises(CorruptionError, match=rf"shard '{rec.shard}'"):
            reader.open(url).read(store.commits[0].n_samples + 1)

    def test_missing_shard_named(self, tmp_path):
        samples = make_samples(12)
        write_samples(str(tmp_path), self.manifest(chunk_tokens=50), samples, shard_bytes=SMALL_SHARD)
        store = reader.open(str(tmp_path))
        rec = store.commits[1]
        gone = glob.glob(os.path.join(str(tmp_path), "shards", glob.escape(rec.shard))) + glob.glob(
            os.path.join(str(tmp_path), "shards", glob.escape(rec.shard) + ".*"))
        assert gone
        for p in gone:
            shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)
        first = store.commits[0].n_samples
        with pytest.raises(CorruptionError, match=rf"shard '{rec.shard}', file shards/{rec.shard}\S*: .*missing"):
            store.read(first)
        assert store.read(0)["sample_id"] == samples[0]["sample_id"]  # other shards still read
        report = verify(store)
        assert not report.ok and {p.shard for p in report.problems} == {rec.shard}
        assert any("missing" in p.message for p in report.problems)

    # -- the loader on this layout --------------------------------------------------------------------
    def test_loader_exactly_once_and_resume(self, tmp_path):
        samples = make_samples(40, max_len=120)
        url = self.loader_store(str(tmp_path / "s"), samples)
        everything = sorted(s["sample_id"] for s in samples)
        by_id = {s["sample_id"]: s for s in samples}
        got = list(dataset(url, layers=[5, 1]))
        assert sorted(ids_of(got)) == everything
        for x in got:
            assert torch.equal(bits(x["hidden_states"]), bits(by_id[x["sample_id"]]["hidden_states"][:, [2, 0]]))
            assert torch.equal(x["input_ids"], by_id[x["sample_id"]]["input_ids"])
        per_rank = collect(url, world=2, workers=2)
        assert sorted(i for r in per_rank for i in r) == everything
        full = ids_of(dataset(url, seed=3))
        for k in (0, 7, len(full) - 1):
            ds = dataset(url, seed=3)
            it = iter(ds)
            head = [next(it)["sample_id"] for _ in range(k)]
            fresh = dataset(url, seed=3)
            fresh.load_state_dict(ds.state_dict())
            assert head + ids_of(fresh) == full, k

    def test_loader_resume_with_dataloader_workers(self, tmp_path):
        url = self.loader_store(str(tmp_path / "s"), make_samples(40, max_len=120))

        def loader(ds):
            return StatefulDataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork")

        full = ids_of(loader(dataset(url, seed=4)))
        dl = loader(dataset(url, seed=4))
        it = iter(dl)
        head = [next(it)["sample_id"] for _ in range(11)]
        state = dl.state_dict()
        del it
        dl2 = loader(dataset(url, seed=4))
        dl2.load_state_dict(state)
        assert head + ids_of(dl2) == full
