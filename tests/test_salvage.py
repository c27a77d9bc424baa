"""Damage costs only what it touched: one flipped byte in a layer chunk (zarr) or member (wds) makes ``verify`` name
exactly the samples behind it, ``subset --skip-corrupt`` copy every other sample bit-exact (naming the ones left
behind, with their count), plain ``subset`` and ``train`` stop with one line naming the shard and the way on; and an
empty result is said, not hidden: a ``subset`` that keeps nothing exits 2 and writes nothing."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

import hsstore
from hsstore.app.cli import main
from hsstore.ops.verify import verify
from hsstore.testing.stores import make_manifest, make_samples, write_store
from train_helpers import FAST, small_input, store32  # noqa: F401  (fixtures)

CHUNK = 64  # the chunk grid of the stores below, in tokens


def damaged_store(tmp_path: Path, layout: str) -> tuple[str, list[str]]:
    """A store of 24 samples in several shards, one byte of one layer-3 chunk (zarr) or member (wds) of its second
    shard flipped; and the ids of the samples that byte's chunk or member holds, worked out from the commit record
    alone: a zarr chunk k holds tokens k*64 .. k*64+63 of its shard, a wds member one sample."""
    url = str(tmp_path / f"src-{layout}")
    write_store(url, make_samples(24, max_len=120), dataclasses.replace(make_manifest(chunk_tokens=CHUNK),
                                                                        layout=layout), shard_tokens=600)
    rec = hsstore.open(url).commits[1]
    ids, off = rec.samples["sample_id"], [int(x) for x in rec.offsets]
    if layout == "zarr":
        k = 1
        path = Path(url, "shards", rec.shard, "layer_003", "c", str(k), "0")
        at = path.stat().st_size // 2
        hit = [ids[i] for i in range(len(ids)) if off[i] < (k + 1) * CHUNK and off[i + 1] > k * CHUNK]
    else:
        i = 2
        path = Path(url, "shards", f"{rec.shard}.tar")
        start, size = rec.members[f"{i:06d}.layer_003.npy"][:2]
        at, hit = start + size // 2, [ids[i]]
    data = bytearray(path.read_bytes())
    data[at] ^= 0x40
    path.write_bytes(bytes(data))
    return url, hit


def stored(url: str) -> dict[str, dict]:
    store = hsstore.open(url)
    return {store.ref(i).sample_id: store.read(i) for i in range(len(store))}


def bits(item: dict) -> bytes:
    return item["hidden_states"].contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("layout", ["zarr", "wds"])
def test_one_bad_byte_costs_only_its_samples(tmp_path, layout, capsys):
    src, hit = damaged_store(tmp_path, layout)
    assert 0 < len(hit) < 24
    # verify names exactly the samples behind the bad chunk or member
    report = verify(hsstore.open(src))
    assert not report.ok and sorted({s for p in report.problems for s in p.samples}) == sorted(hit)
    assert main(["verify", src, "--quiet"]) == 1
    fails = [line for line in capsys.readouterr().out.splitlines() if line.startswith("FAIL")]
    assert fails and all(any(f"samples: {sid}" in line or f", {sid}" in line for line in fails) for sid in hit)

    # subset stops at the first bad read, in one line naming the shard and the salvage
    dst = str(tmp_path / "dst")
    assert main(["subset", src, dst, "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    rec = hsstore.open(src).commits[1]
    assert len(err) == 1 and rec.shard in err[0] and "--skip-corrupt" in err[0], err

    # the salvage: every sample whose bytes verify, bit-exact; the ones left behind named with their count
    assert main(["subset", src, dst, "--quiet", "--skip-corrupt"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and f"{len(hit)} left behind whose bytes do not verify" in out[0], out
    assert all(repr(sid) in out[0] for sid in hit)
    good = hsstore.open(src)
    want = {}
    for i in range(len(good)):
        sid = good.ref(i).sample_id
        if sid not in hit:
            want[sid] = good.read(i)
    got = stored(dst)
    assert sorted(got) == sorted(want) and len(got) == 24 - len(hit)
    for sid, item in want.items():
        assert item["input_ids"].equal(got[sid]["input_ids"]) and item["loss_mask"].equal(got[sid]["loss_mask"])
        assert bits(item) == bits(got[sid])
    assert verify(hsstore.open(dst)).ok
    # resumed: nothing twice, the loss said again in --json
    assert main(["subset", src, dst, "--quiet", "--skip-corrupt", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["written"] == 0 and r["already"] == 24 - len(hit) and sorted(r["corrupt"]) == sorted(hit)


@pytest.mark.parametrize("workers", ["0", "1"])  # in this process, and in a DataLoader worker (re-raised by torch)
def test_train_stops_at_a_bad_chunk_with_one_line_naming_the_shard_and_the_salvage(store32, tmp_path,  # noqa: F811
                                                                                    capsys, workers):
    src = str(tmp_path / "store")
    shutil.copytree(store32, src)
    rec = hsstore.open(src).commits[0]
    chunk = next(Path(src, "shards", rec.shard, "layer_003").rglob("c/*/*"))
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x40
    chunk.write_bytes(bytes(data))
    args = ["train", "--store", src, "--out", str(tmp_path / "run"), "--steps", "3", "--quiet", "--device", "cpu",
            "--token-budget", str(FAST["token_budget"]), "--draft-layers", "1", "--block-size", "8",
            "--workers", workers]
    assert main(args) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("hsstore train: error")]
    assert len(err) == 1, err
    assert rec.shard in err[0] and "checksum" in err[0]
    assert f"hsstore verify {src}" in err[0] and f"hsstore subset {src} NEW --skip-corrupt" in err[0], err


def test_a_subset_that_keeps_nothing_exits_2_and_writes_nothing(tmp_path, capsys):
    src = str(tmp_path / "src")
    write_store(src, make_samples(6, max_len=60))
    dst = tmp_path / "dst"
    assert main(["subset", src, str(dst), "--min-loss-tokens", "100000"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and "--min-loss-tokens 100000" in err[0] and "keep none of the 6 samples" in err[0], err
    assert "nothing written" in err[0] and not dst.exists() and not captured.out
    # an existing empty folder stays as it was
    dst.mkdir()
    assert main(["subset", src, str(dst), "--source", "nowhere"]) == 2
    assert list(dst.iterdir()) == []


def test_a_salvage_that_finds_nothing_good_exits_2_and_writes_nothing(tmp_path, capsys):
    src = str(tmp_path / "src")
    write_store(src, make_samples(2, max_len=30))  # both samples in one chunk of 64 tokens per layer
    rec = hsstore.open(src).commits[0]
    chunk = Path(src, "shards", rec.shard, "layer_003", "c", "0", "0")
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x40
    chunk.write_bytes(bytes(data))
    dst = tmp_path / "dst"
    assert main(["subset", src, str(dst), "--skip-corrupt", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "none of the 2 samples selected" in err[0] and "nothing written" in err[0], err
    assert not dst.exists()
