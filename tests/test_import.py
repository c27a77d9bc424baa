"""`hsstore import`: the peers' per-sample files (SpecForge .ckpt, speculators safetensors + Arrow) into a store,
bit-exact, resumable; bad files refused by name with nothing committed; nothing ever unpickled."""

import gzip
import io
import json
import pathlib

import numpy as np
import pyarrow as pa
import pytest
import torch
from safetensors.torch import save_file

import hsstore
from hsstore.app.cli import main
from hsstore.errors import SampleError
from hsstore.format.manifest import check_compatible
from hsstore.app.schema import build
from hsstore.store.reader import committed_ids

LAYERS, HIDDEN = (1, 3, 5), 48
IDENTITY = ["--layers", "1,3,5", "--model-name", "peer-target", "--num-layers", "8", "--hidden-size", str(HIDDEN),
            "--config-hash", "cfg-peer", "--tokenizer-hash", "vocab-peer", "-q"]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def write_specforge(folder: pathlib.Path, samples, variant: str = "hidden_states") -> None:
    """SpecForge's layout: rows_A-B/data_{i}.ckpt, one torch.save dict per sample."""
    for i, s in enumerate(samples):
        sub = folder / f"rows_{i // 4 * 4}-{i // 4 * 4 + 4}"
        sub.mkdir(parents=True, exist_ok=True)
        hs = s["hidden_states"]
        d = {"input_ids": s["input_ids"], "loss_mask": s["loss_mask"].to(torch.int64)}
        if variant == "hidden_states":
            d["hidden_states"] = hs
        else:  # EAGLE-3 style: taps concatenated along hidden, batch dim, plus the final layer as target
            d["aux_hidden_state"] = hs.reshape(1, hs.shape[0], -1).clone()
            d["hidden_state"] = hs[:, -1].reshape(1, hs.shape[0], HIDDEN).clone()  # real values: zeros are refused
        path = sub / f"data_{i}.ckpt"
        if variant == "gzip":
            buf = io.BytesIO()
            torch.save(d, buf)
            path.write_bytes(gzip.compress(buf.getvalue()))
        else:
            torch.save(d, path)


def write_speculators(folder: pathlib.Path, samples, skip: tuple[int, ...] = ()) -> None:
    """speculators' layout: an Arrow dataset as datasets.save_to_disk writes it (stream format, state.json) with
    input_ids / loss_mask / seq_len, and hidden_states/hs_{i}.safetensors with hidden_states + token_ids."""
    folder.mkdir(parents=True)
    table = pa.table({"input_ids": [s["input_ids"].tolist() for s in samples],
                      "loss_mask": [s["loss_mask"].long().tolist() for s in samples],
                      "seq_len": [len(s["input_ids"]) for s in samples]})
    with pa.OSFile(str(folder / "data-00000-of-00001.arrow"), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table)
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    (folder / "hidden_states").mkdir()
    for i, s in enumerate(samples):
        if i not in skip:
            save_file({"hidden_states": s["hidden_states"].contiguous(), "token_ids": s["input_ids"]},
                      str(folder / "hidden_states" / f"hs_{i}.safetensors"))


def assert_store_holds(url: str, samples, ids) -> None:
    store = hsstore.open(url)
    assert len(store) == len(samples)
    by_id = {sid: i for i, sid in enumerate(store.sample_ids())}
    for sid, s in zip(ids, samples):
        got = store.read(by_id[sid])
        assert torch.equal(got["input_ids"], s["input_ids"])
        assert torch.equal(got["loss_mask"], s["loss_mask"].bool())
        assert torch.equal(bits(got["hidden_states"]), bits(s["hidden_states"]))  # bit-exact


@pytest.mark.parametrize("variant", ["hidden_states", "aux_concat", "gzip"])
def test_specforge_import_bit_exact_and_resumable(tmp_path, new_samples, variant, capsys):
    samples = new_samples(10)
    write_specforge(tmp_path / "sf", samples, variant)
    out = str(tmp_path / "store")
    assert main(["import", "specforge", str(tmp_path / "sf"), "--out", out, "--shard-mb", "0.02", *IDENTITY]) == 0
    assert "10 samples" in capsys.readouterr().out
    assert_store_holds(out, samples, [f"data_{i}" for i in range(10)])
    store = hsstore.open(out)
    assert len(store.commits) > 1  # several shards: the resume below skips committed ones
    m = store.manifest
    assert m.layers == LAYERS and m.target.config_hash == "cfg-peer" and m.tokenizer.vocab_hash == "vocab-peer"
    assert m.extra["imported_from"] == "specforge"
    assert set(c.samples["source"][0] for c in store.commits) == {"sf"}
    assert main(["import", "specforge", str(tmp_path / "sf"), "--out", out, "--shard-mb", "0.02", *IDENTITY]) == 0
    assert "0 samples" in capsys.readouterr().out and len(hsstore.open(out)) == 10  # resumed: nothing twice


def test_speculators_import_bit_exact(tmp_path, new_samples, capsys):
    samples = new_samples(8)
    write_speculators(tmp_path / "spec", samples, skip=(5,))
    out = str(tmp_path / "store")
    assert main(["import", "speculators", str(tmp_path / "spec"), "--out", out, "--id-prefix", "teamB-",
                 *IDENTITY]) == 0
    assert "1 rows without a hidden-state file skipped" in capsys.readouterr().out
    kept = [i for i in range(8) if i != 5]
    assert_store_holds(out, [samples[i] for i in kept], [f"teamB-hs_{i}" for i in kept])
    assert main(["info", out, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["skipped"] == {"no_hidden_states": 1}


class Marker:
    """Unpickling this would create a file: proof of whether anything was unpickled."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.path),))


def test_import_stops_before_writing_when_first_file_is_bad(tmp_path, new_samples, capsys):
    samples = new_samples(2)
    write_specforge(tmp_path / "sf", samples)
    first = tmp_path / "sf" / "rows_0-4" / "data_0.ckpt"
    first.write_bytes(first.read_bytes()[:100])  # truncated (SpecForge counts such a file as done)
    out = tmp_path / "store"
    assert main(["import", "specforge", str(tmp_path / "sf"), "--out", str(out), *IDENTITY]) == 2
    assert str(first) in capsys.readouterr().err
    assert not out.exists()  # the store is created at the first good sample only


def _ckpt(path, **d):
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(d, path)


@pytest.mark.parametrize("case, message", [
    ("no_loss_mask", "missing 'loss_mask'"),
    ("target_only", "final-norm output"),
    ("wrong_hidden", "expected [20, 3, 48] or [20, 144]"),
    ("two_layers", "expected [20, 3, 48]"),
    ("short_features", "holds 19 tokens, input_ids has 20"),
    ("short_mask", "loss_mask has 19 tokens, input_ids has 20"),
    ("both_keys", "ambiguous"),
    ("float32", "dtype float32"),
])
def test_bad_specforge_files_are_refused_by_name(tmp_path, case, message):
    from hsstore.extract import peers
    from hsstore.extract.peers.importing import import_files, peer_files

    g = torch.Generator().manual_seed(1)
    T = 20
    ids, mask = torch.randint(0, 100, (T,), generator=g), torch.ones(T, dtype=torch.int64)
    hs = torch.randn(T, 3, HIDDEN, generator=g).to(torch.bfloat16)
    good = {"input_ids": ids, "loss_mask": mask, "hidden_states": hs}
    bad = dict(good)
    if case == "no_loss_mask":
        del bad["loss_mask"]
    elif case == "target_only":
        del bad["hidden_states"]
        bad["hidden_state"] = hs[:, 0]
    elif case == "wrong_hidden":
        bad["hidden_states"] = hs.reshape(T, -1)[:, :-1]
    elif case == "two_layers":
        bad["hidden_states"] = hs[:, :2]
    elif case == "short_features":
        bad["hidden_states"] = hs[:-1]
    elif case == "short_mask":
        bad["loss_mask"] = mask[:-1]
    elif case == "both_keys":
        bad["aux_hidden_state"] = hs.reshape(T, -1)
    elif case == "float32":
        bad["hidden_states"] = hs.float()
    _ckpt(tmp_path / "sf" / "data_0.ckpt", **good)
    _ckpt(tmp_path / "sf" / "data_1.ckpt", **bad)
    m = hsstore.Manifest(target=hsstore.TargetIdentity("t", 8, HIDDEN, "c"),
                         tokenizer=hsstore.TokenizerIdentity("t", "v"), layers=LAYERS)
    files = peer_files(peers.get("specforge"), str(tmp_path / "sf"), n_layers=3, hidden=HIDDEN)
    out = str(tmp_path / "store")
    with pytest.raises(SampleError, match="data_1") as e:
        import_files(files, out, m, progress=False)
    assert message in str(e.value)
    assert committed_ids(out) == set()


@pytest.mark.parametrize("case, message", [
    ("token_ids", "token_ids differ from input_ids"),
    ("fp8", "fp8-encoded"),
    ("corrupt", "not a readable safetensors file"),
])
def test_bad_speculators_files_are_refused_by_name(tmp_path, new_samples, case, message):
    from hsstore.extract import peers
    from hsstore.extract.peers.importing import import_files, peer_files

    samples = new_samples(3)
    write_speculators(tmp_path / "spec", samples)
    path = tmp_path / "spec" / "hidden_states" / "hs_2.safetensors"
    hs = samples[2]["hidden_states"]
    if case == "token_ids":
        save_file({"hidden_states": hs.contiguous(), "token_ids": samples[1]["input_ids"]}, str(path))
    elif case == "fp8":
        save_file({"hidden_states": hs.contiguous(), "hidden_states_scales": torch.ones(hs.shape[0], 1, 1)},
                  str(path))
    else:
        path.write_bytes(path.read_bytes()[:50])
    m = hsstore.Manifest(target=hsstore.TargetIdentity("t", 8, HIDDEN, "c"),
                         tokenizer=hsstore.TokenizerIdentity("t", "v"), layers=LAYERS)
    files = peer_files(peers.get("speculators"), str(tmp_path / "spec"), n_layers=3, hidden=HIDDEN)
    with pytest.raises(SampleError, match="hs_2.safetensors") as e:
        import_files(files, str(tmp_path / "store"), m, progress=False)
    assert message in str(e.value)
    assert committed_ids(str(tmp_path / "store")) == set()


def test_identity_from_model_dir_matches_extract(tmp_path, tiny_dir, tok, new_samples, capsys):
    """--model DIR hashes config and tokenizer as extract does (without loading weights), so an imported store
    and an extracted one of the same target are compatible: they can be merged or mixed by a loader."""
    from transformers import AutoModelForCausalLM

    from hsstore.extract.target import build_manifest

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    extracted = build_manifest(model, tok, name="tiny", layers=[0, 1])
    H = extracted.hidden_size
    samples = new_samples(2, n_layers=2, hidden=H)
    write_specforge(tmp_path / "sf", samples)
    out = str(tmp_path / "store")
    assert main(["import", "specforge", str(tmp_path / "sf"), "--out", out, "--model", str(tiny_dir),
                 "--layers", "0,1", "-q"]) == 0
    imported = hsstore.open(out).manifest
    check_compatible(imported, extracted, "imported", "extracted")
    assert imported.target.config_hash == extracted.target.config_hash
    assert imported.tokenizer.vocab_hash == extracted.tokenizer.vocab_hash
    assert imported.target.weights_hash is None
    assert main(["import", "specforge", str(tmp_path / "sf"), "--out", str(tmp_path / "s2"), "--model",
                 str(tiny_dir), "--layers", "0,1", "--hidden-size", str(H + 1)]) == 2
    assert "contradicts" in capsys.readouterr().err


def test_import_without_identity_is_refused(tmp_path, new_samples, capsys):
    write_specforge(tmp_path / "sf", new_samples(1))
    assert main(["import", "specforge", str(tmp_path / "sf"), "--out", str(tmp_path / "s"), "--layers", "1,3,5",
                 "--hidden-size", "48"]) == 2
    err = capsys.readouterr().err
    assert "--config-hash" in err and "--tokenizer-hash" in err and not (tmp_path / "s").exists()


# -- layer-id conventions (each peer's LAYERS, extract/peers/; docs/FORMAT.md "Layer ids of the peers") --------------
SPEC_IDENTITY = [a for a in IDENTITY if a not in ("--layers", "1,3,5")]  # 8-layer target, no layer list


def test_speculators_peer_layers_are_converted_and_recorded(tmp_path, new_samples, capsys):
    # speculators' launch_vllm.py default for 8 layers is [2, 8//2, 8-3, 8]; vLLM id i is the residual stream
    # entering decoder layer i (after layer i-1), so the hsstore ids are [1, 3, 4, 7]
    samples = new_samples(3, n_layers=4)
    write_speculators(tmp_path / "spec", samples)
    out = str(tmp_path / "store")
    assert main(["import", "speculators", str(tmp_path / "spec"), "--out", out, "--peer-layers", "2,4,5,8",
                 *SPEC_IDENTITY]) == 0
    m = hsstore.open(out).manifest
    assert m.layers == (1, 3, 4, 7)
    assert m.extra["peer_layers"]["ids"] == [2, 4, 5, 8] and m.extra["peer_layers"]["hsstore_ids"] == [1, 3, 4, 7]
    assert "vllm" in m.extra["peer_layers"]["convention"]
    assert not m.features  # speculators' last slot is the last layer's output before the norm: layer 7, a tap


@pytest.mark.parametrize("layers", ["2,4,5,8", "2,4,5,7", "2,4,5"])
def test_speculators_layers_that_look_like_vllm_ids_are_refused(tmp_path, new_samples, capsys, layers):
    samples = new_samples(2, n_layers=len(layers.split(",")))
    write_speculators(tmp_path / "spec", samples)
    out = tmp_path / "store"
    args = ["import", "speculators", str(tmp_path / "spec"), "--out", str(out), "--layers", layers, *SPEC_IDENTITY]
    assert main(args) != 0
    err = capsys.readouterr().err
    assert "--peer-layers" in err and "--hsstore-ids" in err and not out.exists()
    if layers != "2,4,5,8":  # 8 is no hsstore id of an 8-layer target at all
        assert main(args + ["--hsstore-ids"]) == 0
        assert hsstore.open(str(out)).manifest.layers == tuple(int(x) for x in layers.split(","))


def test_peer_layer_ids_out_of_range_or_doubled_are_refused(tmp_path, new_samples, capsys):
    write_speculators(tmp_path / "spec", new_samples(1, n_layers=2))
    base = ["import", "speculators", str(tmp_path / "spec"), "--out", str(tmp_path / "o"), *SPEC_IDENTITY]
    assert main(base + ["--peer-layers", "0,3"]) != 0 and "embedding" in capsys.readouterr().err
    assert main(base + ["--peer-layers", "3,4", "--layers", "2,3"]) != 0
    assert "exactly one of" in capsys.readouterr().err


def test_specforge_peer_layers_are_hsstore_ids():
    from hsstore.extract.peers import specforge, speculators
    from hsstore.format.serving import specforge_eagle3_ids

    # SpecForge names layer outputs (SGLang captures at id + 1, the residual entering the next layer)
    assert specforge.LAYERS.to_hsstore("specforge", [1, 15, 28], 32) == [1, 15, 28]
    # both peers' default EAGLE-3 taps of one target are the same layers
    launch = speculators.vllm_launch_ids
    assert specforge_eagle3_ids(32) == speculators.LAYERS.to_hsstore("speculators", launch(32, include_last=False), 32)
    assert speculators.LAYERS.to_hsstore("speculators", launch(64), 64) == [1, 31, 60, 63]


# -- SpecForge files as its prepare_hidden_states.py writes them ------------------------------------------------
def specforge_generate(folder: pathlib.Path, samples, batch_size: int, nan_rows=(), group: int = 2000,
                       pad_features=None) -> None:
    """What SpecForge's offline generator writes: consecutive rows in batches, right-padded with zeros to the
    batch's longest (input_ids and loss_mask; the padded row runs through the target, so pad positions carry
    real features), the last partial batch dropped (drop_last=True), NaN rows not saved; per row a torch.save of
    {input_ids [T] int64, loss_mask [T] int64, aux_hidden_state [1, T, L*H], hidden_state [1, T, H]} at
    rows_{g}-{g+group}/data_{i}.ckpt."""
    g = torch.Generator().manual_seed(7)
    for b0 in range(0, len(samples) - batch_size + 1, batch_size):
        batch = samples[b0:b0 + batch_size]
        T = max(len(s["input_ids"]) for s in batch)
        for k, s in enumerate(batch):
            i, n = b0 + k, len(s["input_ids"])
            ids = torch.zeros(T, dtype=torch.int64)
            ids[:n] = s["input_ids"]
            mask = torch.zeros(T, dtype=torch.int64)
            mask[:n] = s["loss_mask"].long()
            L, H = s["hidden_states"].shape[1] - 1, s["hidden_states"].shape[2]
            feats = (torch.randn(T, L + 1, H, generator=g) * 3).to(s["hidden_states"].dtype)
            feats[:n] = s["hidden_states"]
            if i in nan_rows:
                feats[0, 0, 0] = float("nan")
                continue  # SpecForge prints a warning and saves nothing
            sub = folder / f"rows_{i // group * group}-{i // group * group + group}"
            sub.mkdir(parents=True, exist_ok=True)
            torch.save({"input_ids": ids.clone(), "loss_mask": mask.clone(),
                        "aux_hidden_state": feats[:, :L].reshape(1, T, L * H).clone(),
                        "hidden_state": feats[:, L].reshape(1, T, H).clone()}, sub / f"data_{i}.ckpt")


def test_specforge_padding_trimmed_final_hidden_kept_missing_named(tmp_path, new_samples, capsys):
    samples = new_samples(11, n_layers=4, max_len=60)  # 3 taps + the final-norm output in the 4th slot
    for s in samples:  # real rows end in the last assistant span (loss_mask 1), as SpecForge's rows do
        s["loss_mask"][-1] = True
    samples[2]["input_ids"][-1] = 0  # a real last token equal to the pad id, in the loss: kept
    samples[6]["loss_mask"][-3:] = False  # a row ending outside the loss: its padding cannot be told apart
    samples[6]["input_ids"][-1] = 0
    write_kw = dict(batch_size=4, nan_rows=(5,))
    specforge_generate(tmp_path / "sf", samples, **write_kw)  # rows 8-10: the dropped last partial batch
    out = str(tmp_path / "store")
    assert main(["import", "specforge", str(tmp_path / "sf"), "--out", out, "--num-rows", "11", *IDENTITY]) == 0
    text = capsys.readouterr().out
    kept = [0, 1, 2, 3, 4, 6, 7]
    # the padding each batch gave its rows, computed from the lengths
    lens = [len(s["input_ids"]) for s in samples]
    pads = {i: max(lens[b:b + 4]) - lens[i] for b in (0, 4) for i in range(b, b + 4)}
    want_pad = {i: pads[i] for i in kept}
    want_pad[6] = pads[6] + 1  # its real trailing 0 outside the loss is indistinguishable: trimmed too
    assert f"batch padding trimmed from {sum(1 for v in want_pad.values() if v)} rows " \
           f"({sum(want_pad.values()):,} tokens)" in text
    assert "4 rows without a hidden-state file skipped (data_5, data_8, data_9, data_10)" in text
    assert "1 rows whose padding cannot be told from real tokens" in text and "data_6" in text
    store = hsstore.open(out)
    assert store.manifest.features == ("final_hidden",)
    by_id = {store.read(i)["sample_id"]: store.read(i) for i in range(len(store))}
    assert sorted(by_id) == sorted(f"data_{i}" for i in kept)
    for i in kept:
        got, s = by_id[f"data_{i}"], samples[i]
        n = lens[i] - (1 if i == 6 else 0)
        assert torch.equal(got["input_ids"], s["input_ids"][:n])
        assert torch.equal(got["loss_mask"], s["loss_mask"][:n])
        assert torch.equal(bits(got["hidden_states"]), bits(s["hidden_states"][:n, :3]))
        assert torch.equal(bits(got["final_hidden"]), bits(s["hidden_states"][:n, 3]))
    flags = {sid: fl for c in store.commits for sid, fl in zip(c.samples["sample_id"], c.samples["flags"])}
    assert flags["data_6"] == ["padding_ambiguous"] and flags["data_2"] == []
    assert main(["info", out, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["skipped"] == {"no_hidden_states": 4} and info["features"] == ["final_hidden"]


def test_specforge_keep_padding_and_no_final_hidden(tmp_path, new_samples, capsys):
    samples = new_samples(4, n_layers=4, max_len=40)
    for s in samples:
        s["loss_mask"][-1] = True
    specforge_generate(tmp_path / "sf", samples, batch_size=4)
    out = str(tmp_path / "store")
    assert main(["import", "specforge", str(tmp_path / "sf"), "--out", out, "--keep-padding", "--no-final-hidden",
                 *IDENTITY]) == 0
    store = hsstore.open(out)
    T = max(len(s["input_ids"]) for s in samples)
    assert not store.manifest.features and all(store.read(i)["input_ids"].shape[0] == T for i in range(4))
    assert "final_hidden" not in store.read(0)


# -- export to the peers' formats, and back ---------------------------------------------------------------------
def assert_same_store(a: str, b: str) -> None:
    sa, sb = hsstore.open(a), hsstore.open(b)
    assert len(sa) == len(sb) and sa.manifest.layers == sb.manifest.layers
    assert sa.manifest.features == sb.manifest.features
    ib = {sb.read(i)["sample_id"]: sb.read(i) for i in range(len(sb))}
    for i in range(len(sa)):
        x = sa.read(i)
        y = ib[x["sample_id"]]
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"])
        assert torch.equal(bits(x["hidden_states"]), bits(y["hidden_states"]))
        if "final_hidden" in x:
            assert torch.equal(bits(x["final_hidden"]), bits(y["final_hidden"]))


def test_specforge_export_is_what_its_writer_writes_and_imports_back_bit_exact(tmp_path, new_manifest, new_samples,
                                                                               capsys):
    m = hsstore.Manifest(**{**new_manifest(layers=LAYERS).__dict__, "features": ("final_hidden",)})
    samples = new_samples(9, n_layers=4)
    for s in samples[:3]:  # real rows ending in the pad id outside the loss: an export has no padding to trim
        s["input_ids"][-1], s["loss_mask"][-1] = 0, False
    src = str(tmp_path / "src")
    with hsstore.StoreWriter(src, m, shard_bytes=30_000) as w:
        for s in samples:
            w.add(s["sample_id"], s["input_ids"], s["loss_mask"], s["hidden_states"][:, :3],
                  final_hidden=s["hidden_states"][:, 3])
    out = tmp_path / "sf"
    assert main(["export", "specforge", src, str(out), "--layout", "eagle3", "-q"]) == 0
    assert "(eagle3)" in capsys.readouterr().out
    store = hsstore.open(src)
    for i in range(len(store)):
        item = store.read(i)
        d = torch.load(out / "rows_0-2000" / f"data_{i}.ckpt", weights_only=True)
        T = item["input_ids"].shape[0]
        assert list(d) == ["input_ids", "loss_mask", "aux_hidden_state", "hidden_state"]
        assert d["input_ids"].dtype == d["loss_mask"].dtype == torch.int64 and d["input_ids"].shape == (T,)
        assert d["aux_hidden_state"].shape == (1, T, 3 * HIDDEN) and d["hidden_state"].shape == (1, T, HIDDEN)
        assert d["aux_hidden_state"].dtype == torch.bfloat16
        # SpecForge's OfflineEagle3Dataset.process_data: aux -> the drafter's input, hidden_state -> its target
        assert torch.equal(bits(d["aux_hidden_state"][0].reshape(T, 3, HIDDEN)), bits(item["hidden_states"]))
        assert torch.equal(bits(d["hidden_state"][0]), bits(item["final_hidden"]))
    assert main(["export", "specforge", src, str(out), "-q"]) != 0  # never overwrites
    back = str(tmp_path / "back")
    assert main(["import", "specforge", str(out), "--out", back, *IDENTITY]) == 0
    assert "padding" not in capsys.readouterr().out
    assert_same_store(src, back)


def test_speculators_export_is_what_it_reads_and_imports_back_bit_exact(tmp_path, new_manifest, new_samples,
                                                                        capsys, write):
    m = new_manifest(layers=(1, 3, 7))  # an 8-layer target: 7 is the last layer, speculators' verifier slot
    samples = new_samples(7)
    src = str(tmp_path / "src")
    write(src, m, samples, shard_bytes=30_000)
    out = tmp_path / "spec"
    assert main(["export", "speculators", src, str(out), "-q", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["samples"] == 7 and summary["tokens"] == sum(len(s["input_ids"]) for s in samples)
    assert summary["layout"] == "speculators" and summary["out"] == str(out)
    assert any("aux layer ids [2, 4]" in n for n in summary["notes"])
    from hsstore.extract.readers import read_records
    from safetensors.torch import load_file

    rows = list(read_records(out))
    store = hsstore.open(src)
    for i in range(len(store)):
        item = store.read(i)
        d = load_file(str(out / "hidden_states" / f"hs_{i}.safetensors"))
        assert sorted(d) == ["hidden_states", "token_ids"] and d["token_ids"].dtype == torch.int64
        assert torch.equal(d["token_ids"], item["input_ids"]) and rows[i].input_ids.tolist() == d["token_ids"].tolist()
        assert rows[i].loss_mask.tolist() == item["loss_mask"].long().tolist()
        # speculators' ArrowDataset._get_raw_data: all slots but the last -> hidden_states, the last -> verifier
        assert torch.equal(bits(d["hidden_states"][:, :-1]), bits(item["hidden_states"][:, :2]))
        assert torch.equal(bits(d["hidden_states"][:, -1]), bits(item["hidden_states"][:, 2]))
    state = json.loads((out / "state.json").read_text())
    assert state["_format_type"] == "torch" and state["_data_files"] == [{"filename": "data-00000-of-00001.arrow"}]
    back = str(tmp_path / "back")
    assert main(["import", "speculators", str(out), "--out", back, "--peer-layers", "2,4,8", *SPEC_IDENTITY]) == 0
    assert_same_store(src, back)
    # a store without the last layer cannot feed speculators' trainer: refused, nothing written
    write(str(tmp_path / "no-last"), new_manifest(), new_samples(2))
    assert main(["export", "speculators", str(tmp_path / "no-last"), str(tmp_path / "x")]) != 0
    assert "last hidden state" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_export_then_import_gives_a_store_train_and_show_use(tiny_dir, tmp_path, capsys):
    """#38.2: `export specforge` then `import specforge ... --model TARGET` gave bit-exact features but a store
    train and show refused (no assets; show named a temporary folder with an empty reason), and importing
    hsstore's own export asked for the identity its hsstore_export.json records. Now the identity and taps come
    from that file, --model writes the target's config, tokenizer, embedding and lm_head as the store's assets
    (the same bytes extract writes), and without it the summary says how to add them."""
    from hsstore.extract.job import ExtractSettings, run_extract
    from hsstore.extract.tiny import demo_conversations_path

    data = tmp_path / "in.jsonl"
    data.write_text("\n".join(demo_conversations_path().read_text().splitlines()[:4]) + "\n")
    src, exp = tmp_path / "src", tmp_path / "exp"
    run_extract(build(ExtractSettings, model=str(tiny_dir), input=[str(data)], out=str(src), device="cpu",
                      progress=False))
    assert main(["export", "specforge", str(src), str(exp), "-q"]) == 0
    back = tmp_path / "back"
    assert main(["import", "specforge", str(exp), "--out", str(back), "-q"]) == 0  # no identity flags needed
    out = capsys.readouterr().out
    assert "note: the store has no assets" in out and "run this import again with --model DIR" in out
    assert_same_store(str(src), str(back))
    assert main(["show", str(back), "0"]) == 2
    err = capsys.readouterr().err
    assert "holds no tokenizer" in err and "give --model DIR" in err and len(err.strip().splitlines()) == 1
    assert main(["import", "specforge", str(exp), "--out", str(back), "--model", str(tiny_dir), "-q"]) == 0
    assert "written from --model" in capsys.readouterr().out
    for name in ("embed_tokens.safetensors", "lm_head.safetensors", "config.json", "index.json"):
        assert (back / "assets" / name).read_bytes() == (src / "assets" / name).read_bytes(), name
    assert main(["show", str(back), "0"]) == 0 and "<|im_start|>" in capsys.readouterr().out
    assert main(["train", "--store", str(back), "--out", str(tmp_path / "run"), "--steps", "1", "--token-budget",
                 "1024", "--draft-layers", "1", "--block-size", "8", "--anchors", "8", "--device", "cpu", "-q"]) == 0


def test_import_refuses_an_id_a_person_cannot_tell_from_a_stored_one(tmp_path, new_samples, capsys):
    """Two imports into one store whose ids differ only by a zero-width space: the second is refused before
    anything is written, naming both ids (``verify`` would name the pair, ``info`` and ``show`` could not tell
    them apart)."""
    write_speculators(tmp_path / "spec", new_samples(2))
    out = str(tmp_path / "store")
    assert main(["import", "speculators", str(tmp_path / "spec"), "--out", out, "--id-prefix", "b-", *IDENTITY]) == 0
    capsys.readouterr()
    assert main(["import", "speculators", str(tmp_path / "spec"), "--out", out, "--id-prefix", "b-\u200b",
                 *IDENTITY]) == 2
    err = capsys.readouterr().err
    assert "'b-\\u200bhs_0' differs from 'b-hs_0'" in err and "only by invisible characters" in err, err
    assert len(hsstore.open(out)) == 2


def test_import_summary_escapes_the_ids_it_names(tmp_path, new_samples, capsys):
    """The ids a summary names (here a row without its hidden-state file) are the peer folder's strings: an
    invisible character among them is written as its escape."""
    write_speculators(tmp_path / "spec", new_samples(3), skip=(1,))
    out = str(tmp_path / "store")
    assert main(["import", "speculators", str(tmp_path / "spec"), "--out", out, "--id-prefix", "b\u200b-",
                 *IDENTITY]) == 0
    said = capsys.readouterr().out
    assert "skipped (b\\u200b-hs_1)" in said and "\u200b" not in said, said
