"""The index is an accelerator, never an authority (docs/RELIABILITY.md, "Boundaries"): an index segment whose
columns (sample lengths, ids, counts) disagree with the record bytes they summarise -- every checksum valid, the
chunks genuine -- never decides what is read. ``show``, ``subset`` and a loader epoch refuse it in one line naming
the segment and the shard; ``verify`` names the entry."""

from __future__ import annotations

import json
import os

import pytest

import hsstore
from hsstore.app.cli import main
from hsstore.errors import CorruptionError
from hsstore.format import commit, index, records

from conftest import make_manifest, make_samples, write_samples


def _store(url: str) -> None:
    write_samples(url, make_manifest(), make_samples(12, max_len=80), shard_bytes=3 * 48 * 2 * 200)


def forge_columns(url: str, edit) -> tuple[str, str]:
    """Rewrite the one index segment of ``url`` so that the columns of its first shard say what ``edit(d)`` makes of
    that record's JSON, while the segment still holds the record's own bytes (its CRC32C, size and stamp as listed):
    what a reader would take from the index. Returns (segment name, shard)."""
    (name,) = os.listdir(os.path.join(url, index.INDEX_DIR))
    path = os.path.join(url, index.INDEX_DIR, name)
    seg = index.decode_segment(name, open(path, "rb").read())
    t = seg.table
    items = []
    for i in range(len(t)):
        raw = t.raw(i)
        d = json.loads(raw)
        if i == 0:
            edit(d)
        rec = commit.CommitRecord.from_dict(d, "forged")
        items.append((rec, raw, t.stamp[i], int(t.crc32c[i]), int(t.size[i])))
    forged = records.from_records(items)
    open(path, "wb").write(index.encode_segment(seg.kind, seg.writer, forged, seg.supersedes))
    store = hsstore.open(url)
    assert store.index_use.indexed == len(t) and not store.index_use.damaged  # readers take the forged columns
    return name, t.shard[0]


def _shorter(d):
    d["samples"]["length"][0] -= 5
    d["n_tokens"] -= 5


def _renamed(d):
    d["samples"]["sample_id"][0], d["samples"]["sample_id"][1] = d["samples"]["sample_id"][1], \
        d["samples"]["sample_id"][0]


def _one_short(d):
    for col in d["samples"].values():
        del col[-1]
    d["n_samples"] -= 1
    d["n_tokens"] = sum(d["samples"]["length"])


FORGERIES = {"length": _shorter, "sample_id": _renamed, "count": _one_short}


def _one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip() and "%|" not in ln and not ln.startswith("WARNING")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("forgery", sorted(FORGERIES))
@pytest.mark.parametrize("command", ["show", "subset", "export"])
def test_forged_index_columns_are_refused_naming_the_segment(tmp_path, capsys, forgery, command, tiny_dir):
    url = str(tmp_path / "s")
    _store(url)
    seg, shard = forge_columns(url, FORGERIES[forgery])
    sid = json.loads(open(os.path.join(url, commit.commit_path(shard))).read())["samples"]["sample_id"][0]
    out_dir = str(tmp_path / "out")
    argv = {"show": ["show", url, sid, "--model", str(tiny_dir)], "subset": ["subset", url, out_dir, "-q"],
            "export": ["export", "specforge", url, out_dir, "-q"]}[command]
    rc = main(argv)
    got = capsys.readouterr()
    assert rc == 2, got.out[-2000:]
    line = _one_line(got.err)
    assert f"index/{seg}" in line and repr(shard) in line and "disagrees with its commit record" in line, line


@pytest.mark.parametrize("forgery", sorted(FORGERIES))
def test_a_loader_epoch_over_forged_columns_is_refused_not_served(tmp_path, forgery):
    url = str(tmp_path / "s")
    _store(url)
    truth = {it["sample_id"]: it["input_ids"].tolist() for it in hsstore.open(url)}
    seg, shard = forge_columns(url, FORGERIES[forgery])
    ds = hsstore.HiddenStateDataset(url, planning=hsstore.Planning(shuffle=False))
    with pytest.raises(CorruptionError, match="disagrees with its commit record") as e:
        got = {it["sample_id"]: it["input_ids"].tolist() for it in ds}
        assert got == truth  # (what a pass would have to give)
    assert f"index/{seg}" in str(e.value) and repr(shard) in str(e.value)
