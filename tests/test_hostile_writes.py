"""Writers never follow a link they did not make, and the chunk cache deletes only what it wrote (issue #52, item
5): links planted in a store (``index/``, ``locks/``), at a report's temporary name, in place of a cache folder
or above it. Each case runs the real command (or the loader's epoch) and checks that nothing outside changed."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest

import hsstore
from hsstore.app.cli import main

from conftest import make_manifest, make_samples, write_samples


def tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (links as their target): what must not change."""
    return {str(p.relative_to(root)): (os.readlink(p).encode() if p.is_symlink() else p.read_bytes())
            for p in sorted(root.rglob("*")) if p.is_symlink() or p.is_file()}


def victim(tmp_path: Path) -> Path:
    v = tmp_path / "victim"
    v.mkdir()
    for name in ("notes.txt", "w.lock", "report.html", "data.bin"):
        (v / name).write_bytes(b"the user's own file " + name.encode())
    return v


def one_line(rc: int, err: str, *words: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("WARNING") and "%|" not in ln]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, (rc, err)
    assert all(w in lines[0] for w in words), lines[0]
    return lines[0]


def small(url: str, n: int = 6) -> str:
    write_samples(url, make_manifest(chunk_tokens=50), make_samples(n, max_len=80), shard_bytes=200 * 3 * 48 * 2)
    return url


def test_index_never_writes_a_segment_through_a_planted_index_link(tmp_path, capsys):
    url = small(str(tmp_path / "s"))
    v = victim(tmp_path)
    before = tree(v)
    shutil.rmtree(Path(url, "index"))
    os.symlink(v, Path(url, "index"))
    rc = main(["index", url])
    one_line(rc, capsys.readouterr().err, "index", "symbolic link")
    assert tree(v) == before
    assert len(hsstore.open(url)) == 6  # the store reads as before, from its records


def test_subset_never_creates_its_lock_through_a_planted_locks_link(tmp_path, capsys):
    src = small(str(tmp_path / "s"))
    v = victim(tmp_path)
    before = tree(v)
    dst = tmp_path / "dst"
    dst.mkdir()
    os.symlink(v, dst / "locks")
    rc = main(["subset", src, str(dst), "-q"])
    one_line(rc, capsys.readouterr().err, "locks", "symbolic link")
    assert tree(v) == before and sorted(os.listdir(dst)) == ["locks"]


def test_a_lock_released_after_its_folder_became_a_link_removes_nothing_outside(tmp_path, caplog):
    """The lock is removed where it was made: a ``locks/`` swapped for a link to another folder while the job
    ran (a race the creation's own check cannot see) leaves that folder's ``write.lock`` in place."""
    import fsspec

    from hsstore.io import destination

    v = victim(tmp_path)
    (v / "write.lock").write_bytes(b"the user's own lock")
    before = tree(v)
    dst = tmp_path / "dst"
    with destination.hold_lock(fsspec.filesystem("file"), str(dst), str(dst), "merge"):
        assert (dst / "locks" / "write.lock").is_file()
        os.rename(dst / "locks", tmp_path / "moved")
        os.symlink(v, dst / "locks")
    assert tree(v) == before
    assert "could not remove" in caplog.text and "symbolic link" in caplog.text


def test_report_never_overwrites_a_file_through_a_link_at_its_temporary_name(tmp_path, capsys):
    url = small(str(tmp_path / "s"))
    v = victim(tmp_path)
    before = tree(v)
    out = tmp_path / "pages"
    out.mkdir()
    os.symlink(v / "report.html", out / ".tmp-report.html")  # the fixed temporary name it used
    assert main(["report", url, "--out", str(out / "report.html")]) == 0
    assert tree(v) == before
    page = out / "report.html"
    assert not page.is_symlink() and b"hsstore report" in page.read_bytes()


# -- the chunk cache --------------------------------------------------------------------------------------------
def _s3(s3_store, n: int = 8) -> tuple[str, dict]:
    url, opts = s3_store
    write_samples(url, make_manifest(chunk_tokens=50), make_samples(n, max_len=120), storage_options=opts,
                  shard_bytes=200 * 3 * 48 * 2)
    return url, opts


def _epoch(url, opts, cache_dir: str, cache_bytes: int, ds=None):
    ds = ds or hsstore.HiddenStateDataset(url, planning=hsstore.Planning(shuffle=False), storage_options=opts,
                                          reading=hsstore.Reading(cache_dir=cache_dir, cache_bytes=cache_bytes))
    return ds, sorted(item["sample_id"] for item in ds)


def test_a_cache_folder_of_the_users_files_is_refused_and_nothing_deleted(s3_store, tmp_path):
    url, opts = _s3(s3_store)
    v = victim(tmp_path)
    (v / "sub").mkdir()
    (v / "sub" / "deep.txt").write_bytes(b"deep")
    before = tree(v)
    with pytest.raises(hsstore.StoreError, match="not a chunk cache"):
        _epoch(url, opts, str(v), 4096)  # a tiny cap: every write would evict
    assert tree(v) == before
    empty = tmp_path / "empty"
    empty.mkdir()
    _, ids = _epoch(url, opts, str(empty), 1 << 30)  # an empty folder becomes a cache, and a cache is reused
    assert len(ids) == 8 and (empty / ".hsstore-cache-key").is_file()
    assert len(_epoch(url, opts, str(empty), 1 << 30)[1]) == 8


@pytest.mark.parametrize("how", ["world-writable", "another user's"])
def test_a_cache_below_a_folder_others_can_change_is_refused(s3_store, tmp_path, how):
    url, opts = _s3(s3_store)
    shared = tmp_path / "shared"
    shared.mkdir()
    if how == "world-writable":
        shared.chmod(0o777)
    else:
        if os.geteuid() != 0:
            pytest.skip("needs root to make a folder owned by another user")
        os.chown(shared, 12345, 12345)
    with pytest.raises(hsstore.StoreError, match="swap the cache folder"):
        _epoch(url, opts, str(shared / "cache"), 1 << 20)
    shared.chmod(0o777 | stat.S_ISVTX)  # sticky (as /tmp): others cannot rename what is ours
    if how == "world-writable":
        assert len(_epoch(url, opts, str(shared / "cache"), 1 << 20)[1]) == 8


def test_a_cache_folder_swapped_for_a_link_between_epochs_writes_and_deletes_nothing_there(s3_store, tmp_path):
    url, opts = _s3(s3_store)
    v = victim(tmp_path)
    before = tree(v)
    cache = tmp_path / "cache"
    ds, first = _epoch(url, opts, str(cache), 6 << 10)  # small: every epoch evicts
    os.rename(cache, tmp_path / "moved")
    os.symlink(v, cache)  # what another user could do in a shared folder
    _, second = _epoch(url, opts, str(cache), 6 << 10, ds=ds)
    assert second == first and tree(v) == before
    with pytest.raises(hsstore.StoreError, match="refused"):  # a new process (a worker) opens it anew: refused
        _epoch(url, opts, str(cache), 6 << 10)
    assert tree(v) == before
