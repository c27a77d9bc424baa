"""Sizes come from what was verified, never from a member header or a declared length (docs/RELIABILITY.md,
"Boundaries"): a wds member offset moved to a terabyte, or a tar header declaring 10^15 bytes, ends ``verify`` in
seconds with a FAIL naming the shard; ``verify`` decodes every chunk exactly as readers do, so a chunk that
``show`` refuses never passes as OK; a tokenizer asset listed at 6 GiB is one refusal line, not a MemoryError.
Every forged file keeps valid checksums where a forger can make them: only the forged field is wrong."""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import struct
import subprocess
import sys
import tarfile
from pathlib import Path

import numcodecs
import numpy as np
import pytest

import hsstore
from hsstore.app.cli import main
from hsstore.errors import CorruptionError
from hsstore.format import codec, commit
from hsstore.layouts import wds

from conftest import make_manifest, make_samples, write_samples

REPO = Path(__file__).resolve().parents[1]
VERIFY_S = 120  # a verify of these stores takes ~2 s; one that streams a forged size would take hours


def _fails(out: str) -> list[str]:
    return [ln for ln in out.splitlines() if ln.startswith("FAIL")]


def _hsstore(argv, timeout=VERIFY_S, memory=None):
    """(exit status, stdout, stderr) of ``python -m hsstore ARGV`` in a fresh process (``memory``: its address
    space, bytes), killed after ``timeout`` seconds: a command that would stream for hours fails the test."""
    cap = (lambda: resource.setrlimit(resource.RLIMIT_AS, (memory, memory))) if memory else None
    r = subprocess.run([sys.executable, "-m", "hsstore", *argv], capture_output=True, text=True, timeout=timeout,
                       cwd=REPO, preexec_fn=cap)
    return r.returncode, r.stdout, r.stderr


# -- wds: offsets and header sizes ----------------------------------------------------------------------------
def _wds_store(url: str) -> commit.CommitRecord:
    write_samples(url, dataclasses.replace(make_manifest(), layout="wds"), make_samples(6, max_len=60),
                  shard_bytes=1 << 30)
    return hsstore.open(url).commits[0]


def _republish(url: str, rec: commit.CommitRecord, tar: bytes | None = None) -> None:
    """The record published again with the tar's new size and CRC32C (a forger's valid checksums)."""
    path = Path(url, wds.tar_path(rec.shard))
    if tar is not None:
        path.write_bytes(tar)
    size = path.stat().st_size
    crc = codec.crc32c(path.read_bytes()) if size < 1 << 30 else rec.files[wds.tar_path(rec.shard)]["crc32c"]
    rec.files[wds.tar_path(rec.shard)] = {"size": size, "crc32c": crc}
    Path(url, commit.commit_path(rec.shard)).write_bytes(rec.to_json())


def forge_offset(url: str, rec) -> str:
    """The last member's offset moved to 1 TiB in the record, the tar grown (sparse) to end there."""
    last = wds.expected_members(rec, (1, 3, 5))[-1]
    rec.members[last][0] = 1 << 40
    path = Path(url, wds.tar_path(rec.shard))
    os.truncate(path, (1 << 40) + rec.members[last][1] + 1024)
    rec.files[wds.tar_path(rec.shard)]["size"] = path.stat().st_size
    Path(url, commit.commit_path(rec.shard)).write_bytes(rec.to_json())
    return last


def forge_header(url: str, rec, kind: str) -> str:
    """The first member's tar header replaced by one declaring 10^15 bytes: GNU base-256 in its size field, or a
    pax extended header (whose records take the place of the member's data block and the next header)."""
    path = Path(url, wds.tar_path(rec.shard))
    data = bytearray(path.read_bytes())
    first = wds.expected_members(rec, (1, 3, 5))[0]
    at = rec.members[first][0] - tarfile.BLOCKSIZE
    info = tarfile.TarInfo(first)
    info.size, info.mode, info.mtime = 10 ** 15, 0o644, 0
    head = info.tobuf(tarfile.GNU_FORMAT if kind == "base256" else tarfile.PAX_FORMAT)
    assert len(head) == (512 if kind == "base256" else 1536)
    data[at:at + len(head)] = head
    _republish(url, rec, bytes(data))
    return first


@pytest.mark.parametrize("forgery", ["offset-1TiB", "header-base256", "header-pax"])
def test_wds_verify_never_streams_what_a_forged_size_says(tmp_path, forgery):
    url = str(tmp_path / "s")
    rec = _wds_store(url)
    member = forge_offset(url, rec) if forgery == "offset-1TiB" else forge_header(url, rec, forgery.split("-")[1])
    rc, out, err = _hsstore(["verify", url, "-q"])
    fails = _fails(out)
    assert rc == 1 and fails and all(f"shard {rec.shard}" in f for f in fails), (out, err)
    assert member in "\n".join(fails) and "Traceback" not in err, fails


def test_wds_reads_refuse_a_member_moved_from_where_the_tar_holds_it(tmp_path, capsys):
    url = str(tmp_path / "s")
    rec = _wds_store(url)
    forge_offset(url, rec)
    store = hsstore.open(url)
    with pytest.raises(CorruptionError, match="forged or damaged record"):
        store.read(rec.n_samples - 1)
    rc = main(["merge", str(tmp_path / "m"), url, "-q"])  # a copy never fetches more than its members' tar
    err = capsys.readouterr().err
    assert rc == 2 and wds.tar_path(rec.shard) in err and "rule 'extent'" in err, err  # refused before a fetch


# -- zarr: chunks verify calls OK must be chunks readers read ---------------------------------------------------
def _forge_chunk(url: str, array: str, spec: str) -> tuple[str, str]:
    """Chunk 0 of ``array`` of the first shard replaced by bytes readers refuse, its CRC32C tail and the
    record's listing made valid: a compressed frame that declares the chunk's size but does not decode
    (one byte changed, found with numcodecs), or an uncompressed chunk of another size."""
    store = hsstore.open(url)
    rec = store.commits[0]
    key = next(k for k in rec.files if f"/{array}/c/0" in k)
    blob = Path(url, key).read_bytes()
    payload = bytearray(blob[:-4])
    if spec == "none":
        payload = payload[:-8]
    else:
        c = codec._numcodec(spec)
        declared = codec.zstd_content_size if spec == "zstd" else codec.blosc_content_size
        want = declared(payload)
        for pos in range(len(payload)):
            trial = bytearray(payload)
            trial[pos] ^= 0xFF
            if declared(trial) != want:
                continue
            try:
                c.decode(bytes(trial), out=np.empty(want, np.uint8))
            except Exception:  # noqa: BLE001 (the decoder refuses it: what the forgery needs)
                payload = trial
                break
        else:
            pytest.fail("no one-byte change makes the frame undecodable")
    crc = codec.crc32c(bytes(payload))
    forged = bytes(payload) + struct.pack("<I", crc)
    Path(url, key).write_bytes(forged)
    d = json.loads(Path(url, commit.commit_path(rec.shard)).read_text())
    d["files"][key] = {"size": len(forged), "crc32c": crc}
    Path(url, commit.commit_path(rec.shard)).write_text(json.dumps(d))
    return rec.shard, key


@pytest.mark.parametrize("array,spec", [("layer_003", "zstd"), ("layer_003", "lz4"), ("input_ids", "none")])
def test_verify_fails_a_chunk_that_readers_refuse(tmp_path, capsys, array, spec):
    url = str(tmp_path / "s")
    write_samples(url, make_manifest(codec=spec if array.startswith("layer") else "none"),
                  make_samples(4, max_len=50))
    shard, key = _forge_chunk(url, array, spec)
    with pytest.raises(CorruptionError):  # what show and the loader do with it
        hsstore.open(url).read(0)
    rc = main(["verify", url, "-q"])
    fails = _fails(capsys.readouterr().out)
    assert rc == 1 and len(fails) == 1 and f"shard {shard}" in fails[0] and key in fails[0], fails


# -- assets ---------------------------------------------------------------------------------------------------------
@pytest.fixture
def sparse_tokenizer_store(tmp_path, tiny_dir):
    """A store whose tokenizer.json asset is a sparse 6 GiB file, listed at that size in assets/index.json."""
    from hsstore.io import storage
    from hsstore.format.assets import write_assets

    url = str(tmp_path / "s")
    write_samples(url, make_manifest(), make_samples(3, max_len=40))
    tiny = Path(tiny_dir)
    files = {f"tokenizer/{p.name}": p.read_bytes() for p in tiny.iterdir()
             if p.name.startswith(("tokenizer", "special_tokens", "chat_template"))}
    files["config.json"] = (tiny / "config.json").read_bytes()
    write_assets(*storage.resolve(url), files)
    big = Path(url, "assets", "tokenizer", "tokenizer.json")
    os.truncate(big, 6 << 30)
    index = json.loads(Path(url, "assets", "index.json").read_text())
    index["files"]["tokenizer/tokenizer.json"]["size"] = 6 << 30
    Path(url, "assets", "index.json").write_text(json.dumps(index))
    return url


@pytest.mark.parametrize("command", ["show", "verify"])
def test_a_6_GiB_tokenizer_asset_is_one_refusal_line(sparse_tokenizer_store, command):
    url = sparse_tokenizer_store
    rc, out, err = _hsstore(["show", url, "0"] if command == "show" else ["verify", url, "-q"], memory=4 << 30)
    assert "MemoryError" not in err and "Traceback" not in err, err[-2000:]
    if command == "show":
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert rc == 2 and len(lines) == 1, err
        line = lines[0]
    else:
        fails = _fails(out)
        assert rc == 1 and len(fails) == 1, out
        line = fails[0]
    assert "assets/tokenizer/tokenizer.json" in line and "larger than its bound of 268,435,456" in line, line
