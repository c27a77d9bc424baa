"""Every writing command refuses an existing non-empty folder that is not its own kind of output (one line, exit 2,
nothing changed), resumes its own work, and checks an existing store's layout, dtype and taps; the demo deletes
only files it created (issue 26, item 9)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

import hsstore
from hsstore.io import destination
from hsstore.app.cli import main

from conftest import make_manifest, make_samples, write_samples
from train_helpers import FAST, small_input, store32  # noqa: F401  (fixtures)

IDENTITY = ["--layers", "1,3,5", "--model-name", "peer-target", "--num-layers", "8", "--hidden-size", "48",
            "--config-hash", "cfg-peer", "--tokenizer-hash", "vocab-peer", "-q"]


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def user_folder(path: Path) -> dict[str, bytes]:
    """A folder of the user's: an existing zarr group and a config.json where a store would put its assets."""
    (path / "assets").mkdir(parents=True)
    (path / "assets" / "config.json").write_text('{"mine": true}')
    (path / "zarr.json").write_text('{"zarr_format": 3, "node_type": "group", "attributes": {"mine": 1}}')
    return snapshot(path)


def refused(argv, folder: Path, before: dict, capsys, *words):
    rc = main(argv)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip() and "%|" not in ln]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert all(w in lines[0] for w in words), lines[0]
    assert snapshot(folder) == before  # nothing changed, nothing added


@pytest.fixture
def src(tmp_path):
    url = str(tmp_path / "src")
    write_samples(url, make_manifest(), make_samples(4, max_len=40))
    return url


@pytest.mark.parametrize("command", ["subset", "convert", "merge-copy", "merge-reference", "import", "export"])
def test_writing_commands_refuse_a_users_folder(src, tmp_path, command, capsys):
    dst = tmp_path / "mine"
    before = user_folder(dst)
    if command == "import":
        assert main(["export", "specforge", src, str(tmp_path / "sf"), "-q"]) == 0
    argv = {"subset": ["subset", src, str(dst), "-q"],
            "convert": ["convert", src, str(dst), "--layout", "wds", "-q"],
            "merge-copy": ["merge", str(dst), src, "--by", "copy", "-q"],
            "merge-reference": ["merge", str(dst), src, "--by", "reference", "-q"],
            "import": ["import", "specforge", str(tmp_path / "sf"), "--out", str(dst), *IDENTITY],
            "export": ["export", "specforge", src, str(dst), "-q"]}[command]
    refused(argv, dst, before, capsys, str(dst), "not empty", "nothing was written")


def test_extract_refuses_a_users_folder(tiny_dir, small_input, tmp_path, capsys):  # noqa: F811
    dst = tmp_path / "mine"
    before = user_folder(dst)
    refused(["extract", "--model", str(tiny_dir), "--input", str(small_input), "--out", str(dst), "--device", "cpu",
             "-q"], dst, before, capsys, "not empty", "nothing was written")


def test_store_commands_resume_their_own_store(src, tmp_path, capsys):
    dst = str(tmp_path / "sub")
    assert main(["subset", src, dst, "-q"]) == 0
    assert main(["subset", src, dst, "-q"]) == 0  # resumed: nothing left to copy
    assert "0 written" in capsys.readouterr().out and len(hsstore.open(dst)) == 4


def test_resume_checks_layout_dtype_and_taps(src, tmp_path):
    samples = make_samples(2, max_len=40)
    with pytest.raises(hsstore.ManifestError, match="exists with layout 'zarr'; 'wds' was asked for"):
        write_samples(src, dataclasses.replace(make_manifest(), layout="wds"), samples)
    with pytest.raises(hsstore.ManifestError, match="dtype"):
        write_samples(src, make_manifest(dtype="float16"), samples)
    with pytest.raises(hsstore.ManifestError, match="layers"):
        write_samples(src, make_manifest(layers=(1, 3, 6)), samples)
    assert len(hsstore.open(src)) == 4


def test_extract_wds_into_an_existing_zarr_store_is_refused(tiny_dir, small_input, tmp_path, capsys):  # noqa: F811
    out = str(tmp_path / "s")
    argv = ["extract", "--model", str(tiny_dir), "--input", str(small_input), "--out", out, "--device", "cpu", "-q"]
    assert main(argv) == 0
    before = snapshot(Path(out))
    capsys.readouterr()
    refused(argv + ["--layout", "wds"], Path(out), before, capsys, "exists with layout 'zarr'; 'wds' was asked for")


def test_train_out_refuses_a_folder_that_is_not_its_run(store32, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "run"
    (out / "drafter").mkdir(parents=True)
    (out / "drafter" / "config.json").write_text('{"mine": true}')
    before = snapshot(out)
    argv = ["train", "--store", store32, "--out", str(out), "--steps", "1", "--token-budget", "1024",
            "--draft-layers", "1", "--block-size", "8", "--anchors", "32", "--device", "cpu", "-q"]
    refused(argv, out, before, capsys, "train --out", "not empty", "train_config.json")
    fresh = tmp_path / "fresh"
    assert main([*argv[:4], str(fresh), *argv[5:]]) == 0 and (fresh / "train_config.json").exists()
    assert main([*argv[:4], str(fresh), *argv[5:]]) == 0  # its own run: resumed


def test_demo_rerun_keeps_the_users_files(tmp_path):
    from hsstore.extract import demo

    out = tmp_path / "demo"
    demo.prepare_out(out)
    for name in ("run", "store"):  # what a demo run wrote
        (out / name / "sub").mkdir(parents=True)
        (out / name / "sub" / "made.bin").write_bytes(b"demo")
    demo.note_created()
    (out / "run" / "notes.txt").write_text("mine")
    (out / "store" / "sub" / "extra.json").write_text("mine")
    with pytest.raises(ValueError, match="holds files hsstore demo did not create .*run/notes.txt"):
        demo.prepare_out(out)
    assert (out / "run" / "notes.txt").read_text() == "mine" and (out / "run" / "sub" / "made.bin").exists()
    assert (out / "store" / "sub" / "extra.json").read_text() == "mine"
    (out / "run" / "notes.txt").unlink()
    (out / "store" / "sub" / "extra.json").unlink()
    demo.prepare_out(out)  # only the demo's own files left: cleared for the new run
    assert not (out / "run").exists() and not (out / "store").exists()
    assert json.loads((out / demo.MARKER).read_text())["files"] == []



def test_a_store_made_by_another_writer_between_the_two_looks_is_resumed(tmp_path, monkeypatch):
    """Two writers starting one new store at once: the second may find no store on its first look and the first's
    manifest on its listing. That folder is a store now, to resume, not a user's folder to refuse."""
    from hsstore.io import storage

    url = str(tmp_path / "s")
    write_samples(url, make_manifest(), make_samples(3))  # the other writer's store, manifest and all
    fs, root = storage.resolve(url)
    real, looks = storage.store_exists, []

    def store_exists(*args):  # the first look came before the other writer's manifest
        looks.append(args)
        return False if len(looks) == 1 else real(*args)

    monkeypatch.setattr(storage, "store_exists", store_exists)
    destination.check_destination(fs, root, url, {})
    assert len(looks) == 2


def test_another_writers_store_objects_in_flight_are_not_a_users_files(tmp_path):
    """A writer creating a store writes its layout's root objects atomically (a ``.tmp-`` file renamed into
    place), before its manifest. A second writer looking then sees zarr's ``shards/`` folder holding a finished
    ``zarr.json`` and another's temporary file: hsstore's own, not a user's folder to refuse."""
    from hsstore.io import storage
    from hsstore.layouts import base as layout

    own = layout.own_objects()
    root = tmp_path / "s"
    for key, data in own.items():
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_bytes(data)
    (root / "shards" / ".tmp-0123abcd-zarr.json").write_bytes(b"{")  # half of the other writer's copy
    fs, path = storage.resolve(str(root))
    destination.check_destination(fs, path, str(root), own)
    (root / "shards" / "zarr.json").write_bytes(b"{")  # a file of that name that is not the layout's
    with pytest.raises(destination.DestinationError, match="not empty \\(shards\\)"):
        destination.check_destination(fs, path, str(root), own)


def test_a_read_only_destination_is_refused_before_any_request(src, capsys):
    """An HTTP server has no write side: a writing command pointed at one says so in one line, exit 2, and asks
    nothing of it (the port is closed: a request would answer with a connection error instead)."""
    rc = main(["convert", src, "http://127.0.0.1:9/store", "-q"])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert "read only" in lines[0] and "nothing was written" in lines[0], lines[0]
