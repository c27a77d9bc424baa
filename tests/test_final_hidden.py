"""The final_hidden feature: the target's final-norm output (what the lm_head reads, EAGLE-3's target), captured
in the extraction's one forward, named in the manifest, kept by every copy (convert, subset), served by the
loader when asked; stores without it are byte-for-byte what they were."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import hsstore
from hsstore import HiddenStateDataset, Manifest, Planning, Selection, StoreWriter, TokenBatches
from hsstore.loader.batching import collate_packed, collate_padded
from hsstore.app.cli import main as hsstore_cli
from hsstore.errors import ManifestError, SampleError, StoreError
from hsstore.extract.forward import pad_right
from hsstore.extract.job import ExtractSettings, run_extract
from train_helpers import small_input  # noqa: F401  (fixture)
from test_loader_batching import assert_same_batches, direct_and_copied
from hsstore.extract.tokenize import load_samples
from hsstore.format.manifest import canonical_json_hash
from hsstore.ops.verify import verify
from hsstore.app.schema import build


@pytest.fixture(scope="module")
def model32(tiny_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("writer", ["thread", pytest.param("process", marks=pytest.mark.slow)])
def test_extract_final_hidden_is_the_norm_output_hf_and_lm_head_read(tiny_dir, tok, small_input, tmp_path, model32,
                                                                      writer):
    out = str(tmp_path / "store")
    r = run_extract(build(ExtractSettings, model=str(tiny_dir), input=[str(small_input)], out=out, device="cpu",
                          dtype="float32", layers=[1, 4], progress=False, token_budget=700, writer=writer,
                          shard_bytes=60_000, final_hidden=True))
    store = hsstore.open(out)
    assert r.samples == len(store) > 0 and len(store.commits) > 1
    assert store.manifest.layers == (1, 4) and store.manifest.features == ("final_hidden",)
    samples = {s.sample_id: s for s in load_samples(small_input, tok)}
    head = model32.get_output_embeddings().weight
    for i in range(len(store)):
        item = store.read(i)
        s = samples[item["sample_id"]]
        ids, attn = pad_right([s], 0)
        with torch.no_grad():
            ref = model32(ids, attention_mask=attn, output_hidden_states=True)
        # computed independently: HF's last hidden state is the final norm's output, and the lm_head reads it
        torch.testing.assert_close(item["final_hidden"], ref.hidden_states[-1][0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(item["final_hidden"] @ head.T, ref.logits[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(item["hidden_states"][:, 1], ref.hidden_states[5][0], rtol=1e-5, atol=1e-5)
        assert item["hidden_states"].shape[1] == 2  # the layers only
    assert verify(store).ok
    assert hsstore_cli(["info", out, "--json"]) == 0


def test_loader_serves_final_hidden_when_asked(tmp_path, new_manifest, new_samples, monkeypatch):
    m = Manifest(**{**new_manifest().__dict__, "features": ("final_hidden",)})
    samples = new_samples(12, n_layers=4)  # the 4th slot plays the final hidden
    url = str(tmp_path / "s")
    with StoreWriter(url, m, shard_bytes=20_000) as w:
        for s in samples:
            w.add(s["sample_id"], s["input_ids"], s["loss_mask"], s["hidden_states"][:, :3],
                  final_hidden=s["hidden_states"][:, 3])
    by_id = {s["sample_id"]: s for s in samples}
    ds = HiddenStateDataset(url, planning=Planning(shuffle=False), selection=Selection(final_hidden=True))
    items = list(ds)
    assert len(items) == 12
    for it in items:
        s = by_id[it["sample_id"]]
        assert torch.equal(it["final_hidden"].view(torch.int16), s["hidden_states"][:, 3].view(torch.int16))
        assert torch.equal(it["hidden_states"].view(torch.int16), s["hidden_states"][:, :3].view(torch.int16))
    ds_sel = HiddenStateDataset(url, layers=[3], planning=Planning(shuffle=False),
                                selection=Selection(final_hidden=True))
    it = next(iter(ds_sel))
    assert it["hidden_states"].shape[1] == 1 and torch.equal(
        it["final_hidden"].view(torch.int16), by_id[it["sample_id"]]["hidden_states"][:, 3].view(torch.int16))
    plain = next(iter(HiddenStateDataset(url, planning=Planning(shuffle=False))))
    assert "final_hidden" not in plain and plain["hidden_states"].shape[1] == 3
    padded, packed = collate_padded(items[:3]), collate_packed(items[:3])
    n0 = int(padded["lengths"][0])
    assert torch.equal(padded["final_hidden"][0, :n0], items[0]["final_hidden"])
    assert padded["final_hidden"].shape[:2] == padded["input_ids"].shape
    assert torch.equal(packed["final_hidden"][:n0], items[0]["final_hidden"])
    for mode in ("pad", "pack"):  # read straight into their batch slots, or collated: the same batches
        assert_same_batches(*direct_and_copied(lambda: TokenBatches(HiddenStateDataset(
            url, selection=Selection(final_hidden=True)), token_budget=300, mode=mode), monkeypatch))
    assert verify(hsstore.open(url)).ok


def test_writer_refuses_missing_or_unexpected_final_hidden(tmp_path, new_manifest, new_samples):
    s = new_samples(1, n_layers=4)[0]
    m = Manifest(**{**new_manifest().__dict__, "features": ("final_hidden",)})
    with pytest.raises(SampleError, match="final_hidden"):
        with StoreWriter(str(tmp_path / "a"), m) as w:
            w.add("x", s["input_ids"], s["loss_mask"], s["hidden_states"][:, :3])
    with pytest.raises(SampleError, match="final_hidden given"):
        with StoreWriter(str(tmp_path / "b"), new_manifest()) as w:
            w.add("x", s["input_ids"], s["loss_mask"], s["hidden_states"][:, :3], final_hidden=s["hidden_states"][:, 3])
    with pytest.raises(ManifestError, match="raw"):
        Manifest(**{**new_manifest().__dict__, "features": ("final_hidden",), "encoding": "fp8"})
    with pytest.raises(ManifestError, match="not supported"):
        Manifest(**{**new_manifest().__dict__, "features": ("logits",)})


def test_store_without_it_is_unchanged_and_refuses_the_ask(tmp_path, new_manifest, new_samples, write):
    m = new_manifest()
    # the manifest and every shard's key are what they were before the field existed (old readers read them)
    assert "features" not in json.loads(m.to_json())
    want = {"target": {"config_hash": "cfg-a", "num_layers": 8, "hidden_size": 48, "weights_hash": None},
            "tokenizer": {"vocab_hash": "vocab-a", "chat_template_hash": "tmpl"}, "layers": [1, 3, 5],
            "dtype": "bfloat16", "encoding": "raw", "codec": "none", "chunk_tokens": 64}
    assert m.shard_key() == canonical_json_hash(want)
    url = str(tmp_path / "plain")
    write(url, m, new_samples(3))
    assert "final_hidden" not in hsstore.open(url).read(0)
    with pytest.raises(StoreError, match="does not hold it"):
        HiddenStateDataset(url, selection=Selection(final_hidden=True))
    # a store with it names it in the manifest, which older hsstore refuses ("unknown fields") instead of misreading
    with_it = Manifest(**{**m.__dict__, "features": ("final_hidden",)})
    assert json.loads(with_it.to_json())["features"] == ["final_hidden"]
    with pytest.raises(ManifestError, match="features"):  # and the two never share a store
        with StoreWriter(url, with_it):
            pass


def test_convert_and_subset_keep_final_hidden(tmp_path, new_manifest, new_samples, capsys):
    m = Manifest(**{**new_manifest().__dict__, "features": ("final_hidden",)})
    samples = new_samples(6, n_layers=4)
    src = str(tmp_path / "src")
    with StoreWriter(src, m) as w:
        for s in samples:
            w.add(s["sample_id"], s["input_ids"], s["loss_mask"], s["hidden_states"][:, :3],
                  final_hidden=s["hidden_states"][:, 3])
    wds, sub = str(tmp_path / "wds"), str(tmp_path / "sub")
    assert hsstore_cli(["convert", src, wds, "--layout", "wds", "-q"]) == 0
    assert hsstore_cli(["subset", src, sub, "--min-length", "1", "-q"]) == 0
    for url in (wds, sub):
        st = hsstore.open(url)
        assert st.manifest.features == ("final_hidden",) and verify(st).ok
        by_id = {st.read(i)["sample_id"]: st.read(i) for i in range(len(st))}
        for s in samples:
            assert torch.equal(by_id[s["sample_id"]]["final_hidden"].view(torch.int16),
                               s["hidden_states"][:, 3].view(torch.int16))
