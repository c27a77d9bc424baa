"""``export`` and ``export-drafter`` resume their own earlier output, as every writing command does: a re-run of the
same export into its OUT writes only what is not there yet; another export's folder, a changed store or a user's
folder is refused in one line with nothing written."""

from __future__ import annotations

import json
import os

import torch

import hsstore
from hsstore.app.cli import main
from hsstore.extract.peers.exporting import MARKER, SIDECAR
from hsstore.train import drafter_format
from hsstore.train.model import DFlashDrafter, DrafterConfig

HIDDEN = 32


def _store(path, n=7, prefix="s"):
    from conftest import make_manifest, make_samples, write_samples

    write_samples(str(path), make_manifest(hidden=HIDDEN), make_samples(n, hidden=HIDDEN, max_len=40, prefix=prefix))
    return str(path)


def _files(out):
    return sorted(os.path.relpath(os.path.join(d, f), out) for d, _, fs in os.walk(out) for f in fs)


def test_a_specforge_export_cut_short_is_resumed_and_equals_a_whole_one(tmp_path, capsys):
    src = _store(tmp_path / "src")
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert main(["export", "specforge", src, str(whole), "-q"]) == 0
    assert main(["export", "specforge", src, str(cut), "-q"]) == 0
    written = sorted(p for p in _files(cut) if p.endswith(".ckpt"))
    for rel in [SIDECAR, *written[-3:]]:  # an export stopped before its last files and its record
        os.remove(cut / rel)
    capsys.readouterr()
    assert main(["export", "specforge", src, str(cut), "-q"]) == 0
    out = capsys.readouterr().out
    assert f"{len(written) - 3} already there (resumed)" in out, out
    assert _files(cut) == _files(whole)
    for rel in written:
        a, b = torch.load(whole / rel, weights_only=True), torch.load(cut / rel, weights_only=True)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ids = [json.loads((d / SIDECAR).read_text())["sample_ids"] for d in (cut, whole)]
    assert ids[0] == ids[1]
    assert main(["export", "specforge", src, str(cut), "-q"]) == 0  # done: a re-run writes nothing
    assert f"{len(written)} already there" in capsys.readouterr().out


def test_a_speculators_export_run_again_writes_nothing_new(tmp_path, capsys):
    from conftest import make_manifest, make_samples, write_samples

    m = make_manifest(hidden=HIDDEN, layers=(1, 3, 5, 7))
    m = hsstore.Manifest(**{**m.__dict__, "target": hsstore.TargetIdentity(**{**m.target.__dict__,
                                                                              "num_layers": 8})})
    src = str(tmp_path / "src")
    write_samples(src, m, make_samples(5, hidden=HIDDEN, max_len=30, n_layers=4))
    out = tmp_path / "sp"
    assert main(["export", "speculators", src, str(out), "-q"]) == 0
    before = {p: os.stat(out / p).st_mtime_ns for p in _files(out) if p.startswith("hidden_states/")}
    capsys.readouterr()
    assert main(["export", "speculators", src, str(out), "-q"]) == 0
    assert "5 already there (resumed)" in capsys.readouterr().out
    assert {p: os.stat(out / p).st_mtime_ns for p in before} == before


def test_an_export_of_other_samples_or_another_layout_is_refused(tmp_path, capsys):
    src = _store(tmp_path / "src")
    out = tmp_path / "out"
    assert main(["export", "specforge", src, str(out), "-q"]) == 0
    before = _files(out)
    _store(tmp_path / "src", n=2, prefix="late")  # the store grew: file i is no longer its i-th sample
    capsys.readouterr()
    assert main(["export", "specforge", src, str(out), "-q"]) == 2
    err = capsys.readouterr().err
    assert "holds an earlier export" in err and "sample_ids_sha256" in err and "nothing was written" in err, err
    assert _files(out) == before
    users = tmp_path / "users"
    users.mkdir()
    (users / "notes.txt").write_text("mine")
    assert main(["export", "specforge", src, str(users), "-q"]) == 2
    assert "not empty" in capsys.readouterr().err and _files(users) == ["notes.txt"]
    assert MARKER not in _files(users)


def _drafter_dir(path, seed=0):
    torch.manual_seed(seed)
    cfg = DrafterConfig(hidden_size=HIDDEN, intermediate_size=64, vocab_size=100, target_layers=[1, 3],
                        mask_token_id=99, num_heads=2, num_kv_heads=1, head_dim=16, num_layers=1, block_size=4,
                        num_target_layers=4, max_position=256)
    model = DFlashDrafter(cfg, torch.randn(100, HIDDEN), torch.randn(100, HIDDEN))
    return drafter_format.save_drafter(path, model)


def test_export_drafter_replaces_its_own_earlier_export_and_refuses_a_users_folder(tmp_path, capsys):
    a, b = _drafter_dir(tmp_path / "a", seed=0), _drafter_dir(tmp_path / "b", seed=1)
    out = tmp_path / "out"
    assert main(["export-drafter", str(a), str(out), "-q"]) == 0
    assert main(["export-drafter", str(b), str(out), "-q"]) == 0  # its own output: replaced whole
    assert (out / drafter_format.WEIGHTS).read_bytes() == (b / drafter_format.WEIGHTS).read_bytes()
    assert sorted(os.listdir(out)) == sorted(drafter_format.FILES)
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]  # nothing set aside is left
    (out / "notes.txt").write_text("mine")  # now it holds a user's file too
    capsys.readouterr()
    assert main(["export-drafter", str(a), str(out), "-q"]) == 2
    assert "not an empty directory nor a drafter export-drafter wrote" in capsys.readouterr().err
    assert (out / drafter_format.WEIGHTS).read_bytes() == (b / drafter_format.WEIGHTS).read_bytes()
