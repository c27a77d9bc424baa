"""Every registered peer runs one contract (the pattern of tests/test_layout_contract.py): its declaration and its
layer convention; where it exports and imports, a store through ``hsstore export`` and back through ``hsstore
import`` bit-exact, a user's folder never written into, and a broken folder of its files refused in one line with
exit 2 and nothing committed; and, where the peer's own package is installed (tests/peers.txt), its own code
reading the export. A subclass names its peer and builds its broken folders; a peer registered without one fails
here."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import hsstore
from hsstore.app.cli import main
from hsstore.extract import peers
from hsstore.store.reader import committed_ids
from hsstore.testing.stores import make_manifest, make_samples, write_samples
from test_import import Marker, bits

TARGET_LAYERS = 8  # make_manifest's target
TAPS = (1, 3, 7)  # the last layer too: speculators' trainer takes it as the verifier's hidden state
PEER_PACKAGES = "pip install --no-deps -r tests/peers.txt (.ci/run does)"
UNPICKLED = "was-unpickled"  # what a broken folder's pickle creates if anything unpickles it
IDENTITY = ["--layers", ",".join(map(str, TAPS)), "--model-name", "t", "--num-layers", str(TARGET_LAYERS),
            "--hidden-size", "48", "--config-hash", "c", "--tokenizer-hash", "v"]  # a folder without the sidecar


def store_of(tmp_path: Path, n: int = 5) -> tuple[str, list[dict]]:
    samples = make_samples(n, min_len=6, max_len=40)
    for s in samples:
        s["loss_mask"][:3] = True  # two consecutive loss tokens: SpecForge's DFlash reader takes every sample
    src = str(tmp_path / "src")
    write_samples(src, make_manifest(layers=TAPS), samples)
    return src, samples


@dataclass
class Exported:
    """A store and its export as the peer's files, made once per peer: the tests read them, never change them."""

    src: str
    samples: list[dict]
    out: Path


def one_line_refusal(capsys, argv: list[str]) -> str:
    assert main(argv) == 2, argv
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


class PeerContract:
    """Tests every peer passes. Subclasses set ``peer`` and implement ``broken_folders`` where the peer imports
    and ``own_code_reads`` where its package reads an export."""

    peer: str = ""

    @property
    def declaration(self) -> peers.Declaration:
        return peers.PEERS[self.peer]

    @classmethod
    def needs(cls, *offers: str) -> None:
        missing = [o for o in offers if not peers.PEERS[cls.peer].offers(o)]
        if missing:
            pytest.skip(f"{cls.peer} offers no {' or '.join(missing)}")

    # -- what a subclass provides ---------------------------------------------------------------------------
    def broken_folders(self, export: Path, tmp_path: Path) -> list[tuple[Path, str]]:
        """(a folder of the peer's files, broken, made from a copy of the good ``export``; a phrase the one-line
        refusal holds), one per way the peer's files are refused."""
        raise NotImplementedError

    def own_code_reads(self, export: Path, store) -> None:
        """The peer's own released code reads ``export`` and finds ``store``'s values (skipped where its package is
        not installed)."""
        raise NotImplementedError

    @pytest.fixture(scope="class")
    @classmethod
    def exported(cls, tmp_path_factory) -> Exported:
        cls.needs("export")
        root = tmp_path_factory.mktemp(cls.peer)
        src, samples = store_of(root)
        assert main(["export", cls.peer, src, str(root / "out"), "-q"]) == 0
        return Exported(src, samples, root / "out")

    # -- the contract ---------------------------------------------------------------------------------------
    def test_the_registry_gives_the_peers_module(self):
        module = peers.get(self.peer)
        assert module.NAME == self.peer and self.peer in peers.names() and callable(module.ambiguity)
        for offer in peers.OFFERS:
            if self.declaration.offers(offer):
                assert peers.get(self.peer, offer) is module and self.peer in peers.names(offer)
                functions = {"export": ["export"], "import": ["files", "keeps_final_hidden"]}[offer]
                assert all(callable(getattr(module, f, None)) for f in functions), functions
            else:
                with pytest.raises(ValueError, match=f"unknown peer format '{self.peer}'"):
                    peers.get(self.peer, offer)

    def test_its_layer_convention_converts_both_ways_and_refuses_what_has_no_hsstore_id(self):
        c = peers.get(self.peer).LAYERS
        every = list(range(TARGET_LAYERS))
        assert c.to_hsstore(self.peer, c.from_hsstore(every), TARGET_LAYERS) == every
        for outside in (c.offset - 1, TARGET_LAYERS + c.offset):
            with pytest.raises(ValueError, match=f"out of range for {self.peer}'s convention"):
                c.to_hsstore(self.peer, [outside], TARGET_LAYERS)
        assert peers.get(self.peer).ambiguity([1, 2], TARGET_LAYERS) is None  # low ids: nobody's launch default

    def test_an_export_imports_back_bit_exact_with_its_ids_and_taps(self, exported, tmp_path, capsys):
        self.needs("import")
        out, samples, back = exported.out, exported.samples, str(tmp_path / "back")
        sidecar = json.loads((out / "hsstore_export.json").read_text())
        assert sidecar["format"] == self.peer and sidecar["layers"] == list(TAPS)
        assert sidecar["peer_layer_ids"] == peers.get(self.peer).LAYERS.from_hsstore(list(TAPS))
        assert main(["import", self.peer, str(out), "--out", back, "-q"]) == 0  # the sidecar says the identity
        got = hsstore.open(back)
        assert got.manifest.layers == TAPS and got.manifest.extra["imported_from"] == self.peer
        assert got.manifest.extra["peer_layers"]["ids"] == sidecar["peer_layer_ids"]
        assert sorted(got.sample_ids()) == sorted(s["sample_id"] for s in samples)
        by_id = {s["sample_id"]: s for s in samples}
        for i in range(len(got)):
            x = got.read(i)
            want = by_id[x["sample_id"]]
            assert torch.equal(x["input_ids"], want["input_ids"]) and torch.equal(x["loss_mask"], want["loss_mask"])
            assert torch.equal(bits(x["hidden_states"]), bits(want["hidden_states"]))
        capsys.readouterr()

    def test_an_export_never_writes_into_a_users_folder(self, exported, tmp_path, capsys):
        theirs = tmp_path / "theirs"
        theirs.mkdir()
        (theirs / "notes.txt").write_text("mine")
        one_line_refusal(capsys, ["export", self.peer, exported.src, str(theirs), "-q"])
        assert [p.name for p in theirs.iterdir()] == ["notes.txt"] and (theirs / "notes.txt").read_text() == "mine"

    def test_a_broken_folder_is_refused_in_one_line_and_nothing_committed(self, exported, tmp_path, capsys):
        self.needs("import")
        cases = [(tmp_path / "absent", "not found"), *self.broken_folders(exported.out, tmp_path)]
        for i, (folder, phrase) in enumerate(cases):
            dest = tmp_path / f"store{i}"
            err = one_line_refusal(capsys, ["import", self.peer, str(folder), "--out", str(dest), *IDENTITY, "-q"])
            assert phrase in err, (folder, err)
            assert not dest.exists() or committed_ids(str(dest)) == set(), folder  # a good first sample: no commit
        assert not (tmp_path / UNPICKLED).exists()  # nothing of a peer's folder is ever unpickled

    @pytest.mark.slow  # the peer's own package, imported for seconds
    def test_the_peers_own_code_reads_the_export(self, exported):
        self.own_code_reads(exported.out, hsstore.open(exported.src))


def copy_of(export: Path, to: Path) -> Path:
    import shutil

    return Path(shutil.copytree(export, to))


def peer_module(name: str):
    return pytest.importorskip(name, reason=f"needs the peer's package: {PEER_PACKAGES}")


class TestSpecForge(PeerContract):
    peer = "specforge"

    def broken_folders(self, export, tmp_path):
        pickled = copy_of(export, tmp_path / "pickled")
        bad = pickled / "rows_0-2000" / "data_1.ckpt"
        torch.save({**torch.load(bad, weights_only=True), "meta": Marker(tmp_path / UNPICKLED)}, bad)
        cut = copy_of(export, tmp_path / "cut")
        (cut / "rows_0-2000" / "data_0.ckpt").write_bytes((cut / "rows_0-2000" / "data_0.ckpt").read_bytes()[:100])
        linked = copy_of(export, tmp_path / "linked")
        (linked / "rows_0-2000" / "data_9.ckpt").symlink_to(export / "rows_0-2000" / "data_0.ckpt")
        empty = tmp_path / "empty"
        empty.mkdir()
        return [(pickled, "weights_only=True"), (cut, "not a readable torch.save file"),
                (linked, "symbolic link"), (empty, "no .ckpt or .ckpt.gz files")]

    def own_code_reads(self, export, store):
        peer_module("specforge.runtime.data_plane.offline_reader")
        from specforge.algorithms.common.dflash_family_data import normalize_offline_sample
        from specforge.runtime.data_plane.feature_store import load_feature_file
        from specforge.runtime.data_plane.offline_reader import list_feature_files

        files = sorted(list_feature_files(str(export)), key=lambda f: int(Path(f).stem.split("_")[1]))
        assert len(files) == len(store)
        for i, path in enumerate(files):
            item = store.read(i)
            T = len(item["input_ids"])
            got = normalize_offline_sample(load_feature_file(path), max_len=4096)
            assert torch.equal(bits(got["hidden_states"][0].reshape(T, len(TAPS), -1)), bits(item["hidden_states"]))


class TestSpeculators(PeerContract):
    peer = "speculators"

    def broken_folders(self, export, tmp_path):
        from safetensors.torch import load_file, save_file

        moved = copy_of(export, tmp_path / "moved")
        a, b = (moved / "hidden_states" / f"hs_{i}.safetensors" for i in (0, 1))
        save_file(load_file(str(b)), str(a))  # row 1's file at row 0's name
        cut = copy_of(export, tmp_path / "cut")
        hs = cut / "hidden_states" / "hs_2.safetensors"
        hs.write_bytes(hs.read_bytes()[:64])
        no_hs = copy_of(export, tmp_path / "no-hs")
        for p in (no_hs / "hidden_states").iterdir():
            p.unlink()
        (no_hs / "hidden_states").rmdir()
        return [(moved, "token_ids differ from input_ids"), (cut, "hs_2.safetensors"),
                (no_hs, "hidden-state folder not found")]

    def own_code_reads(self, export, store):
        """speculators' ArrowDataset (load_from_disk + its FileTransfer): the store's tokens, loss mask, aux layers
        and the last layer as the verifier's hidden state."""
        data = peer_module("speculators.train.data")
        ds = data.ArrowDataset(max_len=4096, datapath=str(export), on_missing="raise")
        assert len(ds) == len(store)
        for i in range(len(store)):
            item, got = store.read(i), ds._get_raw_data(i)
            T = len(item["input_ids"])
            assert torch.equal(got["input_ids"], item["input_ids"])
            assert got["loss_mask"].tolist() == item["loss_mask"].long().tolist()
            assert torch.equal(bits(got["hidden_states"].reshape(T, 2, 48)), bits(item["hidden_states"][:, :2]))
            assert torch.equal(bits(got["verifier_last_hidden_states"]), bits(item["hidden_states"][:, 2]))


class TestDflash(PeerContract):
    """z-lab's dflash reads drafters (``export-drafter``; its own code on them: tests/test_peers_code.py), no
    store's files: its declaration and convention are its contract, and the commands refuse it by name."""

    peer = "dflash"

    def test_the_commands_offer_it_neither_way(self, tmp_path, capsys):
        for argv in (["export", "dflash", str(tmp_path / "s"), str(tmp_path / "o")],
                     ["import", "dflash", str(tmp_path / "f"), "--out", str(tmp_path / "o")]):
            with pytest.raises(SystemExit) as e:
                main(argv)
            assert e.value.code == 2 and "invalid choice: 'dflash'" in capsys.readouterr().err
        assert not (tmp_path / "o").exists()


def test_every_registered_peer_runs_the_contract():
    covered = {cls.peer for cls in PeerContract.__subclasses__()}
    assert covered == set(peers.names()), f"peers without a contract test class: {set(peers.names()) - covered}"


@pytest.mark.parametrize("old, new", [
    ("hsstore.extract.export.export_specforge", "hsstore.extract.peers.specforge.export"),
    ("hsstore.extract.export.export_speculators", "hsstore.extract.peers.speculators.export"),
    ("hsstore.extract.export.ExportResult", "hsstore.extract.peers.base.ExportResult"),
    ("hsstore.extract.export.SIDECAR", "hsstore.extract.peers.exporting.SIDECAR"),
    ("hsstore.extract.peers.import_files", "hsstore.extract.peers.importing.import_files"),
    ("hsstore.extract.peers.load_ckpt", "hsstore.extract.peers.specforge.load_ckpt"),
    ("hsstore.extract.peers.speculators_files", "hsstore.extract.peers.speculators.speculators_files"),
    ("hsstore.extract.peer_layers.eagle3_taps", "hsstore.extract.peers.specforge.eagle3_taps"),
    ("hsstore.extract.peer_layers.parse_ids", "hsstore.extract.peers.base.parse_ids"),
])
def test_a_moved_name_still_resolves_with_a_deprecation_warning(old, new):
    import importlib

    def resolve(dotted: str):
        module, _, name = dotted.rpartition(".")
        return getattr(importlib.import_module(module), name)

    with pytest.warns(DeprecationWarning, match="is deprecated"):
        assert resolve(old) is resolve(new)


def test_the_old_calls_by_name_still_work_with_a_deprecation_warning(tmp_path):
    from hsstore.extract import export, peer_layers

    with pytest.warns(DeprecationWarning, match="to_hsstore"):
        assert peer_layers.to_hsstore("speculators", [2, 4, 8], 8) == [1, 3, 7]
    with pytest.warns(DeprecationWarning, match="PEER_OFFSET"):
        assert peer_layers.PEER_OFFSET == {"specforge": 0, "speculators": 1}
    with pytest.warns(DeprecationWarning, match="FORMATS"):
        assert peers.FORMATS == ("specforge", "speculators")
    src, _ = store_of(tmp_path, n=2)
    with pytest.warns(DeprecationWarning, match="export_store"):
        assert export.export_store("speculators", src, str(tmp_path / "o"), progress=False).samples == 2
    with pytest.warns(DeprecationWarning, match="peer_files"):
        assert [f.sample_id for f in peers.peer_files("speculators", str(tmp_path / "o"), n_layers=3, hidden=48)] \
            == ["s0", "s1"]
    with pytest.warns(DeprecationWarning, match="export_store"), pytest.raises(ValueError, match="unknown peer"):
        export.export_store("dflash", src, str(tmp_path / "d"))
