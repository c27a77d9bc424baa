"""Token-budget batching: budgets kept, padded and packed layouts right, resume rebuilds the same batches."""

from __future__ import annotations

import pytest
import torch

from hsstore import TokenBatches, collate_packed, collate_padded, count_token_batches, token_batches

from test_loader import StatefulDataLoader, bits, dataset, samples, store_url  # noqa: F401  (fixtures)

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")


def fake(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        T = int(torch.randint(1, 90, (1,), generator=g))
        out.append({"sample_id": f"x{i}", "input_ids": torch.randint(1, 100, (T,), generator=g),
                    "loss_mask": torch.rand(T, generator=g) > 0.5,
                    "hidden_states": torch.randn(T, 2, 4, generator=g).to(torch.bfloat16)})
    return out


@pytest.mark.parametrize("mode", ["pad", "pack"])
def test_budget_kept_nothing_lost(mode):
    items = fake(200)
    batches = list(token_batches(items, token_budget=256, mode=mode))
    assert [x["sample_id"] for b in batches for x in b] == [x["sample_id"] for x in items]
    for b in batches:
        lens = [x["input_ids"].shape[0] for x in b]
        cost = len(b) * max(lens) if mode == "pad" else sum(lens)
        assert cost <= 256 or len(b) == 1
    assert [len(b) for b in token_batches(items[:10], 10_000, max_items=4)] == [4, 4, 2]
    # a sample longer than the budget is a batch of its own, never dropped
    assert [len(b) for b in token_batches(items[:3], token_budget=1, mode=mode)] == [1, 1, 1]
    # counted from lengths alone (a schedule planned before reading), the same batches
    lengths = [int(x["input_ids"].shape[0]) for x in items]
    for budget, most in ((256, None), (100, 3), (1, None)):
        assert count_token_batches(lengths, budget, mode, most) == len(list(token_batches(items, budget, mode, most)))
    assert count_token_batches([], 256, mode) == 0


def test_collate_padded_and_packed():
    items = fake(5)
    b = collate_padded(items, pad_id=7)
    T = max(x["input_ids"].shape[0] for x in items)
    assert b["input_ids"].shape == (5, T) and b["hidden_states"].shape == (5, T, 2, 4)
    for i, x in enumerate(items):
        n = x["input_ids"].shape[0]
        assert b["lengths"][i] == n and b["attention_mask"][i].sum() == n and b["attention_mask"][i, :n].all()
        assert torch.equal(b["input_ids"][i, :n], x["input_ids"]) and (b["input_ids"][i, n:] == 7).all()
        assert torch.equal(b["loss_mask"][i, :n], x["loss_mask"]) and not b["loss_mask"][i, n:].any()
        assert torch.equal(bits(b["hidden_states"][i, :n]), bits(x["hidden_states"]))
        assert (b["hidden_states"][i, n:] == 0).all()
    p = collate_packed(items)
    lens = [x["input_ids"].shape[0] for x in items]
    assert p["cu_seqlens"].tolist() == [0] + torch.tensor(lens).cumsum(0).tolist()
    assert p["cu_seqlens"].dtype == torch.int32 and p["max_seqlen"] == max(lens)
    for i, x in enumerate(items):
        a, e = p["cu_seqlens"][i], p["cu_seqlens"][i + 1]
        assert torch.equal(p["input_ids"][a:e], x["input_ids"]) and torch.equal(p["loss_mask"][a:e], x["loss_mask"])
        assert torch.equal(bits(p["hidden_states"][a:e]), bits(x["hidden_states"]))
        assert p["position_ids"][a:e].tolist() == list(range(lens[i]))


def ids(batches):
    return [b["sample_id"] for b in batches]


@pytest.mark.parametrize("workers", [0, 2])
def test_token_batches_resume(store_url, workers):  # noqa: F811
    def loader():
        tb = TokenBatches(dataset(store_url, seed=5), token_budget=400, mode="pad")
        return StatefulDataLoader(tb, batch_size=None, num_workers=workers,
                                  multiprocessing_context="fork" if workers else None)

    full = ids(loader())
    assert sorted(i for b in full for i in b) == sorted(f"s{i}" for i in range(70))
    dl = loader()
    it = iter(dl)
    head = [next(it)["sample_id"] for _ in range(5)]
    state = dl.state_dict()
    del it
    dl2 = loader()
    dl2.load_state_dict(state)
    assert head + ids(dl2) == full


def test_extraction_batches_follow_the_loaders_rule():
    """extract's forward batches (longest first) obey the same rule as the loader's: sequences x longest <=
    token_budget unless alone, at most max_batch."""
    import numpy as np

    from hsstore.extract.forward import token_budget_batches
    from hsstore.extract.sample import TokenizedSample

    samples = [TokenizedSample(f"s{i}", np.ones(n, np.int32), np.ones(n, np.uint8))
               for i, n in enumerate([5, 90, 40, 40, 300, 7, 7])]
    batches = token_budget_batches(samples, token_budget=100, max_batch=3)
    assert [[s.num_tokens for s in b] for b in batches] == [[300], [90], [40, 40], [7, 7, 5]]
    assert count_token_batches([300, 90, 40, 40, 7, 7, 5], 100, max_items=3) == len(batches)


def test_padded_batch_fits_the_trainer_format(store_url):  # noqa: F811
    b = next(iter(TokenBatches(dataset(store_url), token_budget=512)))
    B, T = b["input_ids"].shape
    assert b["hidden_states"].shape[:2] == (B, T) and b["hidden_states"].shape[2:] == (3, 48)
    assert b["attention_mask"].dtype == torch.bool and b["loss_mask"].shape == (B, T)
    assert B * T <= 512 or B == 1



@pytest.mark.parametrize("mode", ["pad", "pack"])
def test_pin_memory_gives_the_same_batches(store_url, mode):  # noqa: F811
    """Pinned collation (the trainer's in-process path) changes where batches live, never what they hold;
    without an accelerator it falls back to plain memory."""
    plain = list(TokenBatches(dataset(store_url, seed=3), token_budget=400, mode=mode))
    pinned = list(TokenBatches(dataset(store_url, seed=3), token_budget=400, mode=mode, pin_memory=True))
    assert ids(pinned) == ids(plain)
    for a, b in zip(plain, pinned):
        assert torch.equal(bits(a["hidden_states"]), bits(b["hidden_states"]))
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        assert b["hidden_states"].is_pinned() == torch.cuda.is_available()


def test_worker_batches_held_stay_intact(store_url):  # noqa: F811
    """Batches collated in DataLoader workers live in recycled shared memory: held ones are never rewritten."""
    from torch.utils.data import DataLoader

    ref = {x["sample_id"]: bits(x["hidden_states"]).clone() for x in dataset(store_url)}
    for mode in ("pack", "pad"):
        loader = DataLoader(TokenBatches(dataset(store_url, seed=1), token_budget=300, mode=mode), batch_size=None,
                            num_workers=2, multiprocessing_context="fork")
        held = list(loader)
        for _ in loader:  # another epoch while the first is held: its memory must come from elsewhere
            pass
        assert sorted(i for b in held for i in b["sample_id"]) == sorted(ref)
        for b in held:
            want = torch.cat([ref[i] for i in b["sample_id"]])
            if mode == "pad":  # the real rows of each padded sample, in order
                b = {"hidden_states": torch.cat([h[:n] for h, n in zip(b["hidden_states"], b["lengths"])])}
            assert torch.equal(bits(b["hidden_states"]), want)


@pytest.mark.parametrize("mode", ["pad", "pack"])
def test_in_process_batches_reuse_memory_and_held_ones_stay_intact(store_url, mode):  # noqa: F811
    """Unpinned batches of the main process come from recycled memory once the consumer drops them (fresh
    memory faults in page by page), never from a batch still held; the batches equal a fresh collate's."""
    import pickle

    ref = {x["sample_id"]: bits(x["hidden_states"]).clone() for x in dataset(store_url)}
    tb = TokenBatches(dataset(store_url, seed=1), token_budget=300, mode=mode)
    dropped = [b["hidden_states"].data_ptr() for b in tb]  # the consumer drops each batch after use
    assert tb._buffers.reused > 0 and len(set(dropped)) < len(dropped)
    tb.set_epoch(1)
    reused = tb._buffers.reused
    held = list(tb)  # every batch of an epoch held at once: the first from the pool, then fresh memory
    assert tb._buffers.reused > reused
    assert len({b["hidden_states"].data_ptr() for b in held}) == len(held)  # no two held batches share memory
    assert sorted(i for b in held for i in b["sample_id"]) == sorted(ref)
    for b in held:
        want = torch.cat([ref[i] for i in b["sample_id"]])
        if mode == "pad":
            assert all(not h[n:].any() for h, n in zip(b["hidden_states"], b["lengths"]))  # padding zeroed
            b = {"hidden_states": torch.cat([h[:n] for h, n in zip(b["hidden_states"], b["lengths"])])}
        assert torch.equal(bits(b["hidden_states"]), want)
    assert len(pickle.dumps(tb)) < 100_000  # what a spawned worker gets: no pooled memory


def _flip_a_feature_byte(store):
    """Flip one byte of a feature's stored values (a zarr chunk or a wds member) of the store's second shard."""
    import os

    rec = store.commits[1]
    key = next(k for k in sorted(rec.files) if "layer_003" in k) if store.manifest.layout == "zarr" else None
    if key is None:  # wds: inside sample 1's layer 3 member, past its .npy header
        from hsstore.layouts import wds
        key, (off, size, _) = wds.tar_path(rec.shard), rec.members["000001.layer_003.npy"]
        at = off + size - 7
    else:
        at = 200
    path = os.path.join(store.root, key)
    data = bytearray(open(path, "rb").read())
    data[at] ^= 0x40
    open(path, "wb").write(bytes(data))


@pytest.mark.parametrize("layout", ["zarr", "wds"])
@pytest.mark.parametrize("mode", ["pad", "pack"])
def test_direct_batches_check_every_byte_before_use(tmp_path, layout, mode):
    """Samples are read straight into their slots of the batches: a flipped byte there still stops the epoch
    before any batch holding the sample is handed out, naming it; with ``skip_corrupt`` the samples it damaged are
    left out and every batch handed out (those after the skip collated by copy) holds exactly the stored bytes."""
    import dataclasses

    import hsstore
    from hsstore.errors import CorruptionError
    from hsstore.testing.stores import make_manifest, make_samples, write_store

    smp = make_samples(40)
    url = write_store(str(tmp_path / "s"), smp, manifest=dataclasses.replace(make_manifest(), layout=layout),
                      shard_tokens=600)
    store = hsstore.open(url)
    _flip_a_feature_byte(store)
    bad = set()
    for i, sid in enumerate(store.sample_ids()):  # what reading each sample alone refuses (Store.read's path)
        try:
            store.read(i)
        except CorruptionError:
            bad.add(sid)
    assert 0 < len(bad) < 5
    with pytest.raises(CorruptionError, match="sample '(" + "|".join(sorted(bad)) + ")'"):
        list(TokenBatches(dataset(url, seed=2), token_budget=300, mode=mode))
    got = list(TokenBatches(dataset(url, seed=2, skip_corrupt=True), token_budget=300, mode=mode))
    by_id = {s["sample_id"]: s for s in smp}
    assert sorted(i for b in got for i in b["sample_id"]) == sorted(set(by_id) - bad)
    for b in got:
        h = b["hidden_states"]
        for j, sid in enumerate(b["sample_id"]):
            if mode == "pad":
                n = int(b["lengths"][j])
                rows = h[j, :n]
                assert not h[j, n:].any()
            else:
                rows = h[int(b["cu_seqlens"][j]):int(b["cu_seqlens"][j + 1])]
            assert torch.equal(bits(rows), bits(by_id[sid]["hidden_states"]))


def direct_and_copied(make, monkeypatch) -> tuple[list, list]:
    """The batches of ``make()`` (a ``TokenBatches``) read straight into their slots, and read into unit buffers and
    collated (as for a dataset that cannot plan ahead: ``TokenBatches._slots`` gives none)."""
    direct = list(make())
    with monkeypatch.context() as m:
        m.setattr(TokenBatches, "_slots", lambda self, it, pin: None)
        copied = list(make())
    return direct, copied


def assert_same_batches(direct: list, copied: list) -> None:
    """Batches equal key for key, value for value (bits for floats); the direct ones' features a dense view of
    feature-major memory, which ``.to(device)`` copies in one piece (``preserve_format``: the same strides)."""
    assert ids(direct) == ids(copied) and len(direct) > 1
    for a, b in zip(direct, copied):
        assert a.keys() == b.keys()
        for k, v in a.items():
            if isinstance(v, torch.Tensor):
                same = torch.equal(v.contiguous().view(torch.uint8), b[k].contiguous().view(torch.uint8)) \
                    if v.is_floating_point() else torch.equal(v, b[k])
                assert v.shape == b[k].shape and v.dtype == b[k].dtype and same, k
            else:
                assert v == b[k], k
        h = a["hidden_states"]
        assert not h.is_contiguous() and torch.empty_like(h).stride() == h.stride()


def test_direct_batches_are_the_collated_ones(store_url, monkeypatch):  # noqa: F811
    """Read straight into their slots or read into unit buffers and collated: the same batches."""
    for mode in ("pad", "pack"):
        assert_same_batches(*direct_and_copied(
            lambda: TokenBatches(dataset(store_url, seed=4), token_budget=350, mode=mode, max_items=5), monkeypatch))
