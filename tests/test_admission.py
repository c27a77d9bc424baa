"""The admission (hsstore/format/admission.py): what ``verify`` refuses no reader serves. Each family of broken
metadata through the real commands: ``info`` describes the store with the verdict first and exits 1, ``verify``
names the rule, and every reader (the loader, ``train``, ``show``, ``subset``, ``export``) refuses in one line naming
the shard and the rule; then a property test over random mutations of a valid store's metadata."""

from __future__ import annotations

import json
import os
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import hsstore
from hsstore.app.cli import main
from hsstore.errors import StoreError
from hsstore.extract.job import ExtractSettings, run_extract
from hsstore.extract.tiny import demo_conversations_path
from hsstore.app.schema import build
from hsstore.format import codec, commit
from hsstore.ops.verify import verify

from conftest import make_manifest, make_samples, write_samples
from test_index_authority import forge_columns


def one_line(err: str, *words: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip() and "%|" not in ln and not ln.startswith(("WARNING", "INFO"))]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert all(w in lines[0] for w in words), lines[0]
    return lines[0]


def records(url: str) -> list[Path]:
    return sorted(Path(url, "commits").glob("*.json"))


def edit_record(path: Path, edit) -> dict:
    d = json.loads(path.read_text())
    edit(d)
    path.write_text(json.dumps(d))
    return d


def small_store(url: str, n: int = 12, layout: str = "zarr", **kw) -> None:
    m = make_manifest(**kw)
    if layout != "zarr":
        from dataclasses import replace
        m = replace(m, layout=layout)
    write_samples(url, m, make_samples(n, max_len=80), shard_bytes=3 * 48 * 2 * 200)


def assert_refused_everywhere(url: str, tmp_path, capsys, rule: str) -> None:
    """``info`` leads with the verdict and exits 1, ``verify`` names the rule (exit 1), and the loader, ``subset``
    and ``export`` refuse in one line naming the rule."""
    capsys.readouterr()
    assert main(["info", url]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("admission  REFUSED") and any(f"rule '{rule}'" in ln for ln in out[1:4]), out[:4]
    assert main(["verify", url, "-q"]) == 1
    assert any(ln.startswith("FAIL") and f"rule '{rule}'" in ln for ln in capsys.readouterr().out.splitlines())
    with pytest.raises(StoreError, match=f"rule '{rule}'"):  # when the dataset is built, before any plan
        hsstore.HiddenStateDataset(url, planning=hsstore.Planning(shuffle=False))
    outs = {c: tmp_path / c for c in ("subset", "export", "merge", "convert")}
    for argv in (["subset", url, str(outs["subset"]), "-q"], ["export", "specforge", url, str(outs["export"]), "-q"],
                 ["merge", str(outs["merge"]), url, "-q"], ["convert", url, str(outs["convert"]), "--layout", "wds",
                                                            "-q"]):
        assert main(argv) == 2
        one_line(capsys.readouterr().err, f"rule '{rule}'")
    for out in outs.values():  # nothing written
        assert not (out / "commits").exists() or not list((out / "commits").iterdir()), out
    assert not outs["export"].exists()


# -- two identical extract runs into one store ------------------------------------------------------------------
@pytest.fixture(scope="module")
def doubled(tiny_dir, tmp_path_factory):
    """What two identical ``extract`` runs writing into one store at once leave: every sample twice, under two
    writer sessions (the second run's shards and records beside the first's)."""
    base = tmp_path_factory.mktemp("doubled")
    inp = base / "in.jsonl"
    inp.write_text("\n".join(demo_conversations_path().read_text().splitlines()[:4]) + "\n")
    for out in ("a", "b"):
        run_extract(build(ExtractSettings, model=str(tiny_dir), input=[str(inp)], out=str(base / out), device="cpu",
                          progress=False))
    for part in ("shards", "commits"):
        for p in (base / "b" / part).iterdir():
            shutil.copytree(p, base / "a" / part / p.name) if p.is_dir() else shutil.copy(p, base / "a" / part)
    return str(base / "a")


def test_a_store_holding_every_sample_twice_is_refused_by_every_reader(doubled, tmp_path, capsys):
    store = hsstore.open(doubled)
    assert len(store) == 2 * len(set(store.sample_ids()))  # (what the two runs left)
    assert_refused_everywhere(doubled, tmp_path, capsys, "unique-ids")
    rc = main(["train", "--store", doubled, "--out", str(tmp_path / "run"), "--steps", "1", "--device", "cpu", "-q"])
    assert rc == 2
    one_line(capsys.readouterr().err, "rule 'unique-ids'")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    sid = store.sample_ids()[0]
    assert main(["show", doubled, sid]) == 2
    one_line(capsys.readouterr().err, "rule 'unique-ids'")


# -- each rule of the store's columns, from one edit of a record ----------------------------------------------
@pytest.mark.parametrize("rule, edit", [
    ("bounds", lambda d: d["samples"]["loss_tokens"].__setitem__(0, d["samples"]["length"][0] + 5)),
    ("grid", lambda d: d.__setitem__("chunk_tokens", d["chunk_tokens"] * 2)),
    ("grid", lambda d: d["layers"].pop(next(iter(d["layers"])))),
    ("manifest", lambda d: d.__setitem__("manifest_key", "0" * 64)),
    ("session", lambda d: d.__setitem__("writer", "someone-else")),
    ("lookalike-ids", lambda d: d["samples"]["sample_id"].__setitem__(1, d["samples"]["sample_id"][0] + "\u200b")),
], ids=["bounds", "chunk-grid", "features", "manifest", "session", "lookalike-ids"])
def test_each_rule_of_the_columns_is_named_by_info_and_refuses_the_loader(tmp_path, capsys, rule, edit):
    url = str(tmp_path / "s")
    small_store(url)
    d = edit_record(records(url)[1], edit)
    assert main(["info", url]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("admission  REFUSED") and f"rule '{rule}'" in out[1] and d["shard"] in out[1], out[:3]
    with pytest.raises(StoreError, match=f"rule '{rule}'|differs from the manifest"):
        hsstore.HiddenStateDataset(url)
    assert main(["subset", url, str(tmp_path / "d"), "-q"]) == 2
    one_line(capsys.readouterr().err, f"rule '{rule}'", d["shard"])


def test_forged_counts_in_index_columns_are_refused(tmp_path, capsys):
    """An index entry whose columns' lengths do not add up to its token count (a table no record parses into)."""
    from hsstore.format import index

    url = str(tmp_path / "s")
    small_store(url)
    (name,) = os.listdir(os.path.join(url, index.INDEX_DIR))
    path = os.path.join(url, index.INDEX_DIR, name)
    seg = index.decode_segment(name, open(path, "rb").read())
    t = seg.table
    t.ints["n_tokens"] = t.ints["n_tokens"].copy()
    t.ints["n_tokens"][0] += 7
    open(path, "wb").write(index.encode_segment(seg.kind, seg.writer, t, seg.supersedes))
    assert main(["info", url]) == 1
    assert "rule 'counts'" in capsys.readouterr().out
    with pytest.raises(StoreError, match="rule 'counts'"):
        hsstore.HiddenStateDataset(url)


# -- a record listing many zero-length samples --------------------------------------------------------------------
def test_zero_length_samples_are_refused_not_served(tmp_path, capsys):
    url = str(tmp_path / "s")
    small_store(url)

    def pad(d):
        k = 2000
        for col, v in (("sample_id", None), ("source", ""), ("length", 0), ("loss_tokens", 0),
                       ("thinking_tokens", 0), ("flags", [])):
            d["samples"][col] += [f"z{i}" for i in range(k)] if v is None else [v] * k
        d["n_samples"] += k

    edit_record(records(url)[0], pad)
    assert len(hsstore.open(url)) > 2000  # (opened: the record parses)
    assert_refused_everywhere(url, tmp_path, capsys, "non-empty")


# -- sample boundaries shifted inside a record --------------------------------------------------------------------
def _shift(d, by=3):
    d["samples"]["length"][0] += by
    d["samples"]["length"][1] -= by


def test_shifted_sample_boundaries_are_refused_by_show_and_the_reader(tmp_path, capsys, tiny_dir):
    url = str(tmp_path / "s")
    small_store(url)
    d = edit_record(records(url)[0], _shift)
    sid = d["samples"]["sample_id"][0]
    store = hsstore.open(url)
    with pytest.raises(StoreError, match="rule 'extent'.*samples.length"):
        store.read(store.sample_ids().index(sid))
    with pytest.raises(StoreError, match="rule 'extent'"):
        list(hsstore.HiddenStateDataset(url, planning=hsstore.Planning(shuffle=False)))
    assert main(["show", url, sid, "--model", str(tiny_dir)]) == 2
    one_line(capsys.readouterr().err, "rule 'extent'", d["shard"])
    assert main(["verify", url, "-q"]) == 1
    assert f"FAIL shard {d['shard']}" in capsys.readouterr().out


@pytest.mark.parametrize("column", ["sample_id", "source"])
def test_a_wds_record_whose_columns_are_not_its_tars_is_refused_by_show_and_the_reader(tmp_path, capsys, tiny_dir,
                                                                                        column):
    """A wds tar holds each sample's columns in its ``.json`` member, which readers never read: an id or source
    edited in the record alone (its members' sizes and checksums as listed) is refused by ``show``, the reader and
    ``subset`` as ``verify`` refuses it, from the record, before a byte of the tar is read."""
    url = str(tmp_path / "s")
    small_store(url, layout="wds")
    d = edit_record(records(url)[0], lambda d: d["samples"][column].__setitem__(0, "renamed"))
    sid = d["samples"]["sample_id"][0]
    with pytest.raises(StoreError, match="rule 'extent'.*not those its tar holds"):
        list(hsstore.HiddenStateDataset(url, planning=hsstore.Planning(shuffle=False)))
    assert main(["show", url, sid, "--model", str(tiny_dir)]) == 2
    one_line(capsys.readouterr().err, "rule 'extent'", d["shard"])
    assert main(["subset", url, str(tmp_path / "d"), "-q"]) == 2
    one_line(capsys.readouterr().err, "rule 'extent'", d["shard"])
    assert main(["verify", url, "-q"]) == 1
    assert f"FAIL shard {d['shard']}" in capsys.readouterr().out


@pytest.mark.parametrize("by", [-2, 2])  # across masked tokens; inside the next sample's prompt (no sum changes)
def test_shifted_boundaries_of_a_record_without_an_offsets_checksum_are_refused_from_its_offsets(tmp_path, capsys,
                                                                                                   by):
    """A format-version-1 record lists no payload checksum that binds its lengths: a reader first touching the
    shard reads its offsets array (one small object) and refuses lengths that are not its boundaries, whether or
    not the moved boundary changes a sample's loss tokens; ``copy``, which copies the shard's files as they are,
    refuses it too."""
    url = str(tmp_path / "s")
    samples = make_samples(8, min_len=20, max_len=21)
    for s in samples:  # a prompt, then an answer
        s["loss_mask"][:] = torch.arange(len(s["loss_mask"])) >= 10
    write_samples(url, make_manifest(), samples, shard_bytes=3 * 48 * 2 * 200)

    def as_version_1(d):
        _shift(d, by=by)
        d["format_version"] = 1
        for key, e in d["files"].items():
            if commit.is_chunk_key(key):
                e["crc32c"] = codec.CHUNK_RESIDUE

    d = edit_record(records(url)[0], as_version_1)
    with pytest.raises(StoreError, match="rule 'extent'") as e:
        list(hsstore.HiddenStateDataset(url, planning=hsstore.Planning(shuffle=False)))
    assert d["shard"] in str(e.value)
    with pytest.raises(StoreError, match="rule 'extent'"):
        list(hsstore.open(url))
    assert main(["copy", url, str(tmp_path / "c"), "-q"]) == 2
    one_line(capsys.readouterr().err, "rule 'extent'", d["shard"])


@pytest.mark.parametrize("layout, rule", [("zarr", "served"), ("wds", "extent")])  # a tar's members name the columns
def test_convert_writes_no_shard_whose_record_miscounts_a_samples_loss_tokens(tmp_path, capsys, layout, rule):
    """A record whose second sample's loss tokens are not what its loss_mask holds (the record forged, its checksums
    intact): ``verify`` refuses the shard, the loader refuses the sample, and ``convert``, which copies a shard whole,
    ``copy`` and ``merge``, which hand its files on as they are, refuse it in one line before writing any of it."""
    url, dst = str(tmp_path / "s"), str(tmp_path / "d")
    samples = make_samples(8, min_len=20, max_len=21)
    for s in samples:
        s["loss_mask"][:] = torch.arange(len(s["loss_mask"])) >= 10
    m = make_manifest()
    if layout != "zarr":
        from dataclasses import replace
        m = replace(m, layout=layout)
    write_samples(url, m, samples, shard_bytes=3 * 48 * 2 * 200)
    d = edit_record(records(url)[0], lambda d: d["samples"]["loss_tokens"].__setitem__(1, 9))
    with pytest.raises(StoreError, match=f"rule '{rule}'"):  # the loader holds each sample it serves so too
        list(hsstore.HiddenStateDataset(url, planning=hsstore.Planning(shuffle=False)))
    assert main(["verify", url, "-q"]) == 1
    assert f"FAIL shard {d['shard']}" in capsys.readouterr().out
    other = "wds" if layout == "zarr" else "zarr"
    assert main(["convert", url, dst, "--layout", other, "-q"]) == 2
    one_line(capsys.readouterr().err, f"rule '{rule}'", d["shard"], d["samples"]["sample_id"][1])
    written = [p.stem for p in Path(dst, "commits").glob("*.json")] if Path(dst, "commits").is_dir() else []
    assert d["shard"] not in written
    for argv in (["copy", url, str(tmp_path / "c"), "-q"], ["merge", str(tmp_path / "m"), url, "-q"]):  # files as
        assert main(argv) == 2  # they are: the mask (a byte a token) read and held to the record, nothing written
        one_line(capsys.readouterr().err, f"rule '{rule}'", d["shard"])
        assert not list(Path(argv[2] if argv[0] == "copy" else argv[1]).glob("commits/*.json"))


def _mask_token_set(url: str, d: dict, token: int, value: int = 1) -> None:
    """Token ``token`` of record ``d``'s shard set to ``value`` in its loss_mask, and every checksum of the bytes (a zarr chunk's
    tail, a tar member's and the tar's) and the record's copies of them made to agree: the record's loss tokens are
    then all that tells the forged mask."""
    if "members" in d:  # wds: the sample's .loss_mask.npy member, its data the last bytes of it
        i = int(np.searchsorted(np.cumsum(d["samples"]["length"]), token, side="right"))
        name = f"{i:06d}.loss_mask.npy"
        at, size, _ = d["members"][name]
        tar = Path(url, commit.SHARDS_DIR, f"{d['shard']}.tar")
        data = bytearray(tar.read_bytes())
        data[at + size - d["samples"]["length"][i] + token - sum(d["samples"]["length"][:i])] = value
        tar.write_bytes(bytes(data))
        d["members"][name][2] = codec.crc32c(bytes(data[at:at + size]))
        d["files"][f"{commit.SHARDS_DIR}/{d['shard']}.tar"]["crc32c"] = codec.crc32c(bytes(data))
        return
    key = f"{commit.SHARDS_DIR}/{d['shard']}/loss_mask/c/0"  # zarr: its first chunk, then its CRC32C tail
    data = bytearray(Path(url, key).read_bytes())
    data[token] = value
    crc = codec.crc32c(bytes(data[:-4]))
    data[-4:] = np.uint32(crc).tobytes()
    Path(url, key).write_bytes(bytes(data))
    d["files"][key]["crc32c"] = crc


@pytest.mark.parametrize("layout", ["zarr", "wds"])
@pytest.mark.parametrize("at, value, served", [(2, 1, "holds 11 loss tokens.*says 10"),
                                               (12, 2, "other than 0 and 1 \\(2\\)")],
                         ids=["prompt token set", "loss token 2"])
def test_a_loss_mask_rewritten_with_its_checksums_is_refused_by_verify_the_loader_and_merge(tmp_path, capsys, layout,
                                                                                            at, value, served):
    """A shard's loss_mask rewritten (one prompt token of a sample set; or a loss token's byte 2, which no writer
    writes, its count unchanged) with every checksum made to agree: only the record's loss tokens and the rule's 0
    and 1 tell it. ``verify`` names the sample (``loss_mask sums disagree``), the loader refuses it (rule
    ``served``), and ``merge`` and ``copy``, which read the mask alone, refuse the shard before writing it."""
    url = str(tmp_path / "s")
    samples = make_samples(8, min_len=20, max_len=21)
    for s in samples:
        s["loss_mask"][:] = torch.arange(len(s["loss_mask"])) >= 10
    from dataclasses import replace
    write_samples(url, replace(make_manifest(), layout=layout), samples, shard_bytes=3 * 48 * 2 * 200)
    d = edit_record(records(url)[0], lambda d: _mask_token_set(url, d, d["samples"]["length"][0] + at, value))
    sid = d["samples"]["sample_id"][1]
    assert main(["verify", url, "-q"]) == 1
    out = capsys.readouterr().out
    (line,) = [ln for ln in out.splitlines() if "loss_mask sums disagree with the commit record" in ln]
    assert d["shard"] in line and sid in line, out
    (p,) = [p for p in verify(hsstore.open(url)).problems if "loss_mask" in p.message]
    assert p.samples == [sid]  # the one sample whose mask was set, no other
    with pytest.raises(StoreError, match=f"rule 'served'.*{served}") as e:
        list(hsstore.HiddenStateDataset(url, planning=hsstore.Planning(shuffle=False)))
    assert sid in str(e.value)
    for argv in (["merge", str(tmp_path / "m"), url, "-q"], ["copy", url, str(tmp_path / "c"), "-q"]):
        assert main(argv) == 2
        one_line(capsys.readouterr().err, "rule 'served'", d["shard"], sid)
        assert not list(Path(argv[1] if argv[0] == "merge" else argv[2]).glob("commits/*.json"))


@pytest.mark.parametrize("how, words", [("unlisted", "not listed in the commit record"), ("removed", "missing")],
                         ids=["unlisted", "removed"])
def test_a_zarr_loss_mask_chunk_unlisted_or_missing_is_refused_by_merge_and_copy_in_one_line(tmp_path, capsys, how,
                                                                                             words):
    """The mask ``merge`` and ``copy`` read alone is read at the sizes the record lists: a chunk it does not list,
    or one gone from the store, is the shard's corruption, one line naming the shard and file, nothing written."""
    url = str(tmp_path / "s")
    small_store(url)
    key = None

    def unlist(d):
        nonlocal key
        key = f"{commit.SHARDS_DIR}/{d['shard']}/loss_mask/c/0"
        if how == "unlisted":
            del d["files"][key]
        else:
            os.remove(Path(url, key))

    d = edit_record(records(url)[0], unlist)
    for argv in (["merge", str(tmp_path / "m"), url, "-q"], ["copy", url, str(tmp_path / "c"), "-q"]):
        assert main(argv) == 2
        one_line(capsys.readouterr().err, f"shard {d['shard']!r}, file {key}: {words}")
        assert not list(Path(argv[1] if argv[0] == "merge" else argv[2]).glob("commits/*.json"))


# -- index columns that disagree with their record ---------------------------------------------------------------
def _no_loss(d):
    d["samples"]["loss_tokens"] = [0] * len(d["samples"]["loss_tokens"])


def test_forged_columns_never_decide_which_samples_an_epoch_holds(tmp_path, capsys):
    """Columns that say a shard's samples have no loss tokens, with a filter on loss tokens: the shard is never
    read, so its record is admitted when the filters drop its samples (not only when read)."""
    url = str(tmp_path / "s")
    small_store(url)
    seg, shard = forge_columns(url, _no_loss)
    with pytest.raises(StoreError, match="disagrees with its commit record") as e:
        hsstore.HiddenStateDataset(url, selection=hsstore.Selection(min_loss_tokens=1))
    assert repr(shard) in str(e.value)
    assert main(["subset", url, str(tmp_path / "d"), "--min-loss-tokens", "1", "-q"]) == 2
    one_line(capsys.readouterr().err, "disagrees with its commit record", shard)


def _no_samples(d):
    for col in d["samples"].values():
        col.clear()
    d["n_samples"] = d["n_tokens"] = 0


def test_columns_that_list_no_sample_of_a_shard_never_decide_what_is_read(tmp_path, capsys):
    """An index entry whose columns list none of its shard's samples (the record lists them): no reader reads that
    shard, so each admits it before leaving it out; the loader, ``Store`` iteration, ``subset`` and ``export``
    refuse naming the shard, where they served the other shards' samples, one short."""
    url = str(tmp_path / "s")
    small_store(url)
    seg, shard = forge_columns(url, _no_samples)
    assert len(hsstore.open(url)) < len(hsstore.Store(url, use_index=False))  # (what the columns say)
    with pytest.raises(StoreError, match="disagrees with its commit record") as e:
        hsstore.HiddenStateDataset(url, planning=hsstore.Planning(shuffle=False))
    assert repr(shard) in str(e.value)
    with pytest.raises(StoreError, match="disagrees with its commit record"):
        list(hsstore.open(url))
    for argv in (["subset", url, str(tmp_path / "d"), "-q"], ["export", "specforge", url, str(tmp_path / "e"), "-q"]):
        assert main(argv) == 2
        one_line(capsys.readouterr().err, "disagrees with its commit record", shard)
    assert main(["verify", url, "-q"]) == 1


# -- wds tars whose bytes after the last member are a member --------------------------------------------------
@pytest.mark.parametrize("kind", ["symlink", "fifo", "huge"])
def test_a_wds_tar_with_a_member_after_its_listed_ones_fails_verify(tmp_path, capsys, kind):
    url = str(tmp_path / "s")
    small_store(url, layout="wds")
    rec_path = records(url)[0]
    d = json.loads(rec_path.read_text())
    tar = Path(url, commit.SHARDS_DIR, f"{d['shard']}.tar")
    data = bytearray(tar.read_bytes())
    end = max(at + size + (-size % tarfile.BLOCKSIZE) for at, size, _ in d["members"].values())
    info = tarfile.TarInfo("evil")
    if kind == "symlink":
        info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
    elif kind == "fifo":
        info.type = tarfile.FIFOTYPE
    else:
        info.size = 10 ** 15
    data[end:end + tarfile.BLOCKSIZE] = info.tobuf(tarfile.GNU_FORMAT)[:tarfile.BLOCKSIZE]
    tar.write_bytes(bytes(data))  # the record made to agree: its tar's CRC32C is the new bytes'
    d["files"][f"{commit.SHARDS_DIR}/{d['shard']}.tar"]["crc32c"] = codec.crc32c(bytes(data))
    rec_path.write_text(json.dumps(d))
    assert main(["verify", url, "-q"]) == 1
    out = capsys.readouterr().out
    want = {"symlink": "symlink", "fifo": "fifo", "huge": "1,000,000,000,000,000 bytes"}[kind]
    assert any(ln.startswith("FAIL") and "after the last listed one" in ln and want in ln for ln in out.splitlines()), out


# -- a damaged commit record and manifest --------------------------------------------------------------------------
def test_a_damaged_commit_record_is_a_fail_line_naming_the_file_and_field(tmp_path, capsys):
    url = str(tmp_path / "s")
    small_store(url)
    path = records(url)[1]
    path.write_bytes(path.read_bytes().replace(b'"n_tokens"', b'"n_tokenz"'))  # one flipped byte
    key = f"commits/{path.name}"
    assert main(["verify", url, "-q"]) == 1
    fails = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("FAIL")]
    assert len(fails) == 1 and key in fails[0] and "n_tokenz" in fails[0] and "__init__" not in fails[0], fails
    assert main(["info", url]) == 1  # described, the verdict first
    out = capsys.readouterr().out
    assert out.startswith("admission  REFUSED") and key in out and "samples " in out, out
    with pytest.raises(StoreError, match="rule 'record'.*n_tokenz"):
        list(hsstore.HiddenStateDataset(url))


# -- the property: a sample is served only if verify accepts its shard ---------------------------------------------
BASE: dict[str, str] = {}


def base_store(tmp: str) -> str:
    if "url" not in BASE:
        url = os.path.join(tmp, "base")
        write_samples(url, make_manifest(), make_samples(12, min_len=4, max_len=60),
                      shard_bytes=3 * 48 * 2 * 150)
        BASE["url"] = url
    return BASE["url"]


def mutate(d: dict, what: str, k: int, v: int) -> None:
    """One edit of a record's metadata (``k`` picks a sample, ``v`` a value)."""
    s = d["samples"]
    n = len(s["length"])
    k %= n
    if what == "id":
        s["sample_id"][k] = f"s{v % 16}"  # another sample's id, or one no sample has
    elif what == "length":
        s["length"][k] = max(0, s["length"][k] + v)
        d["n_tokens"] = sum(s["length"])
    elif what == "shift" and n > 1:
        j = (k + 1) % n
        v = max(-s["length"][j], min(v, s["length"][k]))
        s["length"][k] -= v
        s["length"][j] += v
    elif what == "count":
        for col in s.values():
            del col[k]
        d["n_samples"] -= 1
        d["n_tokens"] = sum(s["length"])
    elif what == "zero":
        for col, x in (("sample_id", f"z{v}"), ("source", ""), ("length", 0), ("loss_tokens", 0),
                       ("thinking_tokens", 0), ("flags", [])):
            s[col].append(x)
        d["n_samples"] += 1
    elif what == "loss":
        s["loss_tokens"][k] = max(0, s["loss_tokens"][k] + v)
    elif what == "offsets":
        key = next(f for f in d["files"] if f.endswith("/offsets/c/0"))
        d["files"][key]["crc32c"] = (d["files"][key]["crc32c"] + v) % (1 << 32)
    elif what == "name":
        d["writer"] = f"w{v}"
    elif what == "grid":
        d["chunk_tokens"] = max(1, d["chunk_tokens"] + v)
    elif what == "layers":
        d["layers"].pop(next(iter(d["layers"])))


# a sample's loss tokens alone are held per sample as it is served (rule 'served'), the whole shard only by verify
MUTATIONS = ["id", "length", "shift", "count", "zero", "offsets", "name", "grid", "layers"]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.lists(st.tuples(st.sampled_from(MUTATIONS), st.integers(0, 2), st.integers(0, 40),
                                st.integers(-5, 5), st.booleans()), min_size=1, max_size=3))
def test_a_sample_is_served_only_if_verify_accepts_its_shard(tmp_path_factory, edits):
    """Random edits of a valid store's commit records (ids, lengths, counts, offsets, names, grid, features), each
    in the record itself or only in its index entry's columns: whatever the loader and ``Store`` iteration serve,
    ``verify`` accepts the shard it comes from (and the store as a whole)."""
    tmp = str(tmp_path_factory.getbasetemp())
    url = os.path.join(tmp, f"case-{os.getpid()}-{np.random.randint(1 << 30)}")
    shutil.copytree(base_store(tmp), url)
    try:
        paths = records(url)
        for n, (what, shard, k, v, in_index) in enumerate(edits):
            if in_index and n == 0:  # the records as they were, an index entry's columns forged
                forge_columns(url, lambda d: mutate(d, what, k, v))
            else:
                edit_record(paths[shard % len(paths)], lambda d: mutate(d, what, k, v))
        try:
            store = hsstore.open(url)
        except StoreError:
            return  # refused at open: nothing served
        report = verify(store)
        refused = {p.shard for p in report.problems}
        whole = bool(store.breaches()) or any(s.startswith("(") for s in refused)
        holders: dict[str, set[str]] = {}
        for i, sid in enumerate(store.sample_ids()):
            holders.setdefault(sid, set()).add(store.ref(i).shard)
        for serve in (lambda: hsstore.HiddenStateDataset(url, planning=hsstore.Planning(shuffle=False)),
                      lambda: hsstore.open(url)):
            served = []
            try:
                for item in serve():
                    served.append(item["sample_id"])
            except StoreError:
                pass
            for sid in served:
                assert not whole, (edits, report.problems[:3], sid)
                assert sid in holders and not holders[sid] & refused, (edits, sid, [str(p) for p in report.problems])
    finally:
        shutil.rmtree(url, ignore_errors=True)
