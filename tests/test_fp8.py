"""The fp8 encoding: quantisation bounds, the store round trip (local and S3), extraction with
``--encoding fp8``, the loader and trainer on an fp8 store, and refusals."""

import dataclasses
import json
import math

import numpy as np
import pytest
import torch

import hsstore
from conftest import make_manifest, make_samples
from hsstore.extract.job import ExtractSettings, run_extract
from hsstore.extract.tiny import demo_conversations_path
from hsstore.format import commit, fp8
from hsstore.layouts import zarr as zarr_layout
from hsstore.app.cli import main as hsstore_cli
from hsstore.errors import ManifestError, SampleError
from hsstore.ops.info import summarize
from hsstore.ops.verify import verify
from hsstore.app.schema import build
from hsstore.train.trainer import TrainSettings, train
from train_helpers import FAST
from test_loader_batching import assert_same_batches, direct_and_copied


def fp8_manifest(**kw):
    return dataclasses.replace(make_manifest(**kw), encoding="fp8")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


# ------------------------------------------------------------------------------------------ quantisation


def test_quantise_error_bounds_and_numpy_form():
    g = torch.Generator().manual_seed(0)
    # rows with very different magnitudes and a heavy tail, as hidden states have
    x = (torch.randn(256, 512, generator=g) * torch.logspace(-3, 3, 256)[:, None])
    x[:, :4] *= 50
    x = x.to(torch.bfloat16)
    q = fp8.quantise(x)
    assert q.values.dtype == torch.float8_e4m3fn and q.scales.dtype == torch.float32
    assert q.values.shape == x.shape and q.scales.shape == (256,)
    torch.testing.assert_close(q.scales, x.float().abs().amax(-1) / 448, rtol=0, atol=0)
    d = fp8.dequantise(q.values, q.scales, torch.float32)
    xf = x.float()
    err = (d - xf).abs()
    s = q.scales[:, None]
    normal = xf.abs() >= 2.0 ** -6 * s  # e4m3 normals: 3 mantissa bits, round to nearest
    assert normal.float().mean() > 0.9
    assert bool((err[normal] <= 2.0 ** -4 * xf.abs()[normal] * (1 + 1e-6)).all())
    assert bool((err[~normal] <= 2.0 ** -10 * s.expand_as(xf)[~normal] * (1 + 1e-6)).all())  # subnormals
    assert float((d - xf).norm(dim=-1).div(xf.norm(dim=-1)).max()) < 2.0 ** -4
    # the numpy-bit form decodes the same values from the stored bits
    npd = fp8.dequantise_numpy(fp8.as_bits(q.values), q.scales.numpy())
    assert np.array_equal(npd, d.numpy())
    assert fp8.dequantise(q.values, q.scales).dtype == torch.bfloat16


def test_representable_values_are_exact():
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 256, (64, 128), generator=g, dtype=torch.int32).to(torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x40  # no NaN codes
    v = codes.view(torch.float8_e4m3fn).float()
    v[:, 0] = 448.0 * torch.where(torch.rand(64, generator=g) < 0.5, -1.0, 1.0)  # amax row: scale is 2^k
    x = (v * 2.0 ** torch.randint(-20, 10, (64, 1), generator=g).float()).to(torch.bfloat16)
    q = fp8.quantise(x)
    assert torch.equal(bits(q.values), bits(v.to(torch.float8_e4m3fn)))
    assert torch.equal(fp8.dequantise(q.values, q.scales), x)


def test_zero_rows():
    x = torch.zeros(3, 16, dtype=torch.bfloat16)
    x[1, 5] = 2.5
    q = fp8.quantise(x)
    assert q.scales[0] == 1 and q.scales[2] == 1 and not bool(bits(q.values[[0, 2]]).any())
    assert torch.equal(fp8.dequantise(q.values, q.scales), x)


# ------------------------------------------------------------------------------------------ the store


def check_store(store, samples):
    by_id = {s["sample_id"]: s for s in samples}
    assert len(store) == len(samples)
    for i in range(len(store)):
        raw = store.read(i, dequantise=False)
        want = fp8.quantise(by_id[raw["sample_id"]]["hidden_states"])
        assert raw["hidden_states"].dtype == torch.float8_e4m3fn
        assert torch.equal(bits(raw["hidden_states"]), bits(want.values))  # bit-exact fp8 bits
        assert torch.equal(raw["hidden_scales"], want.scales)  # and scales
        assert torch.equal(raw["input_ids"], by_id[raw["sample_id"]]["input_ids"])
        human = store.read(i)  # dequantised on the host into the manifest dtype
        assert torch.equal(human["hidden_states"], fp8.dequantise(want.values, want.scales, torch.bfloat16))
        sub = store.read(i, layers=[store.layers[-1]], dequantise=False)
        assert torch.equal(bits(sub["hidden_states"]), bits(want.values[:, -1:]))
        assert torch.equal(sub["hidden_scales"], want.scales[:, -1:])


@pytest.mark.parametrize("where", ["local", "s3"])
def test_store_roundtrip_fp8_bits_and_scales(where, tmp_path, request):
    if where == "s3":
        url, opts = request.getfixturevalue("s3_store")
    else:
        url, opts = str(tmp_path / "store"), {}
    m = fp8_manifest(chunk_tokens=50)  # samples span chunk boundaries
    samples = make_samples(24 if where == "local" else 6, seed=3)  # the loopback S3 server is slow
    with hsstore.StoreWriter(url, m, shard_bytes=3 * 48 * 300, storage_options=opts) as w:
        for j, s in enumerate(samples):  # quantised by the caller (as extraction does) or by the writer
            hs = fp8.quantise(s["hidden_states"]) if j % 2 else s["hidden_states"]
            w.add(s["sample_id"], s["input_ids"], s["loss_mask"], hs)
    store = hsstore.open(url, **opts)
    assert len(store.commits) > 1 and store.manifest.encoding == "fp8"
    check_store(store, samples)
    assert [x["sample_id"] for x in store] == store.sample_ids()  # the windowed scan path too
    report = verify(store)
    assert report.ok, [str(p) for p in report.problems]
    info = summarize(store)
    assert info["encoding"] == "fp8"
    # values (1 B) plus one float32 scale per token per layer, plus the padding of the last chunks
    tokens = sum(len(s["input_ids"]) for s in samples)
    assert 3 * (48 + 4) <= info["bytes_per_token"] < 3 * (48 + 4) * 1.6
    assert info["dtype_bytes_per_token"] == 3 * 48 * 2
    assert info["raw_feature_bytes"] == tokens * 3 * (48 + 4)


def test_zarr_python_reads_fp8_arrays(tmp_path):
    import zarr

    samples = make_samples(4, seed=5)
    with hsstore.StoreWriter(str(tmp_path), fp8_manifest()) as w:
        for s in samples:
            w.add(s["sample_id"], s["input_ids"], s["loss_mask"], s["hidden_states"])
    store = hsstore.open(str(tmp_path))
    g = zarr.open_group(str(tmp_path), path=f"shards/{store.commits[0].shard}", mode="r")
    a, sc = g["layer_003"], g["scale_003"]
    assert a.dtype == np.uint8 and a.attrs["hsstore_dtype"] == "float8_e4m3fn" and sc.dtype == np.float32
    first = fp8.quantise(samples[0]["hidden_states"][:, 1])
    n = len(samples[0]["input_ids"])
    assert np.array_equal(a[:n], fp8.as_bits(first.values)) and np.array_equal(sc[:n], first.scales.numpy())


def test_nonfinite_refused_and_nothing_written(tmp_path):
    s = make_samples(2, seed=4)
    bad = s[1]["hidden_states"].clone()
    bad[7, 2, 3] = float("nan")
    with hsstore.StoreWriter(str(tmp_path), fp8_manifest()) as w:
        w.add(s[0]["sample_id"], s[0]["input_ids"], s[0]["loss_mask"], s[0]["hidden_states"])
        with pytest.raises(SampleError, match=r"sample 's1': layer 5 has NaN/Inf features \(first at token 7\)"):
            w.add("s1", s[1]["input_ids"], s[1]["loss_mask"], bad)
        q = fp8.quantise(s[1]["hidden_states"])
        q.scales[4, 0] = float("inf")
        with pytest.raises(SampleError, match="layer 1 has NaN/Inf"):
            w.add("s1", s[1]["input_ids"], s[1]["loss_mask"], q)
    store = hsstore.open(str(tmp_path))
    assert store.sample_ids() == ["s0"]
    check_store(store, s[:1])


def test_verify_names_samples_with_bad_scales(tmp_path):
    m = dataclasses.replace(fp8_manifest(), chunk_tokens=64)
    s = make_samples(3, seed=6, max_len=40)
    hsstore.StoreWriter(str(tmp_path), m).close()  # creates the store
    store0 = hsstore.open(str(tmp_path))
    qs = [fp8.quantise(x["hidden_states"]) for x in s]
    values = torch.cat([q.values for q in qs])
    scales = torch.cat([q.scales for q in qs])
    scales[len(s[0]["input_ids"]) + 1, 1] = 0.0  # a zero scale in sample s1, layer 3
    cols = {"sample_id": [x["sample_id"] for x in s], "source": [""] * 3,
            "length": [len(x["input_ids"]) for x in s], "loss_tokens": [int(x["loss_mask"].sum()) for x in s],
            "thinking_tokens": [0] * 3, "flags": [[] for _ in s]}
    feats = {l: fp8.as_bits(values[:, j]) for j, l in enumerate(m.layers)}
    sc = {l: scales[:, j].numpy() for j, l in enumerate(m.layers)}
    ids = torch.cat([x["input_ids"] for x in s]).numpy()
    mask = torch.cat([x["loss_mask"] for x in s]).numpy()
    rec = zarr_layout.write_shard(store0.fs, store0.root, "w-00000000-00000", "w", store0.manifest, feats, ids, mask,
                                  cols, scales=sc)
    commit.publish(store0.fs, store0.root, rec)
    problems = verify(hsstore.open(str(tmp_path))).problems
    assert len(problems) == 1 and "layer 3: 1 scales not finite and positive" in str(problems[0])
    assert problems[0].samples == ["s1"]


def scale_past_bfloat16(url: str) -> None:
    """An fp8 store at ``url`` of samples s0, s1 in one shard whose scale of s1's second token in layer 5 is a
    finite, positive 1e36 (no writer writes one: 448 x scale is past bfloat16's largest)."""
    m = dataclasses.replace(fp8_manifest(), chunk_tokens=64)
    s = make_samples(2, seed=6, max_len=40)
    hsstore.StoreWriter(url, m).close()
    store0 = hsstore.open(url)
    qs = [fp8.quantise(x["hidden_states"]) for x in s]
    values, scales = torch.cat([q.values for q in qs]), torch.cat([q.scales for q in qs])
    scales[len(s[0]["input_ids"]) + 1, 2] = 1e36  # sample s1, layer 5
    assert not torch.isfinite(fp8.dequantise(values, scales)).all()
    cols = {"sample_id": [x["sample_id"] for x in s], "source": [""] * 2,
            "length": [len(x["input_ids"]) for x in s], "loss_tokens": [int(x["loss_mask"].sum()) for x in s],
            "thinking_tokens": [0] * 2, "flags": [[] for _ in s]}
    rec = zarr_layout.write_shard(store0.fs, store0.root, "w-00000000-00000", "w", store0.manifest,
                                  {l: fp8.as_bits(values[:, j]) for j, l in enumerate(m.layers)},
                                  torch.cat([x["input_ids"] for x in s]).numpy(),
                                  torch.cat([x["loss_mask"] for x in s]).numpy(), cols,
                                  scales={l: scales[:, j].numpy() for j, l in enumerate(m.layers)})
    commit.publish(store0.fs, store0.root, rec)


def test_verify_names_samples_whose_scales_decode_past_bfloat16(tmp_path):
    """A store holding such a scale: readers decode its row to infinities in the store's bfloat16, so verify fails
    it, naming the sample."""
    scale_past_bfloat16(str(tmp_path))
    problems = verify(hsstore.open(str(tmp_path))).problems
    assert len(problems) == 1 and "layer 5: 1 scales so large that their rows decode past bfloat16" in str(
        problems[0]), problems
    assert problems[0].samples == ["s1"]


@pytest.mark.parametrize("how", [["--codec", "zstd"], ["--encoding", "raw"]])
def test_convert_refuses_a_scale_past_bfloat16_and_copies_a_clean_store(tmp_path, capsys, how):
    """``convert`` of that store, bit-exact into another codec (its scales copied beside) or decoded into raw:
    refused in one line naming the sample, the layer and the token, exit 2, nothing written; a clean fp8 store
    converted so verifies."""
    url, dst = str(tmp_path / "s"), str(tmp_path / "d")
    scale_past_bfloat16(url)
    assert hsstore_cli(["convert", url, dst, *how, "-q"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and "sample 's1': layer 5 has NaN/Inf features (first at token 1)" in err[0], err
    assert not hsstore.open(dst).commits
    clean, out = str(tmp_path / "c"), str(tmp_path / "o")
    with hsstore.StoreWriter(clean, fp8_manifest()) as w:
        for x in make_samples(4, seed=2, max_len=40):
            w.add(x["sample_id"], x["input_ids"], x["loss_mask"], x["hidden_states"])
    assert hsstore_cli(["convert", clean, out, *how, "-q"]) == 0
    assert hsstore_cli(["verify", out, "-q"]) == 0 and len(hsstore.open(out)) == 4


def test_unknown_encoding_and_mixing_refused(tmp_path):
    m = make_manifest()
    d = json.loads(m.to_json())
    with pytest.raises(ManifestError, match="encoding 'fp4' not supported"):
        hsstore.Manifest.from_dict({**d, "encoding": "fp4"})
    s = make_samples(1)
    with hsstore.StoreWriter(str(tmp_path), fp8_manifest()) as w:
        w.add("a", s[0]["input_ids"], s[0]["loss_mask"], s[0]["hidden_states"])
    with pytest.raises(ManifestError, match="encoding: 'fp8' vs 'raw'"):
        hsstore.StoreWriter(str(tmp_path), m)  # a raw writer cannot join an fp8 store
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "encoding": "fp4"}))
    with pytest.raises(ManifestError, match="encoding 'fp4' not supported"):
        hsstore.open(str(tmp_path))


def test_loader_items_and_batches(tmp_path, monkeypatch):
    samples = make_samples(12, seed=7)
    with hsstore.StoreWriter(str(tmp_path), fp8_manifest(chunk_tokens=50)) as w:
        for s in samples:
            w.add(s["sample_id"], s["input_ids"], s["loss_mask"], s["hidden_states"])
    by_id = {s["sample_id"]: fp8.quantise(s["hidden_states"][:, [0, 2]]) for s in samples}
    ds = hsstore.HiddenStateDataset(str(tmp_path), layers=[1, 5])
    items = list(ds)
    assert sorted(x["sample_id"] for x in items) == sorted(by_id)
    for x in items:
        assert torch.equal(bits(x["hidden_states"]), bits(by_id[x["sample_id"]].values))
        assert torch.equal(x["hidden_scales"], by_id[x["sample_id"]].scales)
    batch = hsstore.collate_padded(items[:3])
    B, T = batch["input_ids"].shape
    assert batch["hidden_states"].dtype == torch.float8_e4m3fn and batch["hidden_scales"].shape == (B, T, 2)
    deq = fp8.dequantise_batch(batch)
    assert "hidden_scales" not in deq and deq["hidden_states"].dtype == torch.bfloat16
    for b, x in enumerate(items[:3]):
        n = len(x["input_ids"])
        assert torch.equal(deq["hidden_states"][b, :n], fp8.dequantise(x["hidden_states"], x["hidden_scales"]))
        assert not bool(deq["hidden_states"][b, n:].float().any())
    packed = hsstore.collate_packed(items[:3])
    assert torch.equal(fp8.dequantise_batch(packed)["hidden_states"],
                       torch.cat([fp8.dequantise(x["hidden_states"], x["hidden_scales"]) for x in items[:3]]))
    for mode in ("pad", "pack"):  # e4m3fn bits and scales read straight into their batch slots, or collated
        assert_same_batches(*direct_and_copied(lambda: hsstore.TokenBatches(
            hsstore.HiddenStateDataset(str(tmp_path), layers=[1, 5]), token_budget=300, mode=mode), monkeypatch))
    host = list(hsstore.HiddenStateDataset(str(tmp_path), layers=[1, 5], reading=hsstore.Reading(dequantise=True)))
    assert [x["sample_id"] for x in host] == [x["sample_id"] for x in items]
    assert all("hidden_scales" not in h and torch.equal(h["hidden_states"], fp8.dequantise(
        x["hidden_states"], x["hidden_scales"])) for h, x in zip(host, items))


# ------------------------------------------------------------------------------------------ extraction + training


@pytest.fixture(scope="module")
def two_stores(tiny_dir, tmp_path_factory):
    """The same eight conversations extracted into a bf16 store (API, writer threads) and an fp8 store (CLI,
    writer process), same batching."""
    root = tmp_path_factory.mktemp("fp8")
    path = root / "in.jsonl"
    path.write_text("\n".join(demo_conversations_path().read_text().splitlines()[:8]) + "\n")
    bf16, f8 = str(root / "bf16"), str(root / "fp8")
    run_extract(build(ExtractSettings, model=str(tiny_dir), input=[str(path)], out=bf16, device="cpu", layers=[1, 4],
                      token_budget=700, progress=False))
    rc = hsstore_cli(["extract", "--model", str(tiny_dir), "--input", str(path), "--out", f8, "--device", "cpu",
                      "--layers", "1,4", "--token-budget", "700", "--encoding", "fp8", "-q",
                      "--writer", "process"])  # fp8 values and scales through the shared-memory staging too
    assert rc == 0
    return bf16, f8


def test_extract_fp8_equals_quantised_bf16_extraction(two_stores):
    a, b = (hsstore.open(u) for u in two_stores)
    assert b.manifest.encoding == "fp8" and b.manifest.dtype == "bfloat16" and len(a) == len(b) == 8
    index = {sid: i for i, sid in enumerate(a.sample_ids())}
    for i, sid in enumerate(b.sample_ids()):
        want = fp8.quantise(a.read(index[sid])["hidden_states"])
        got = b.read(i, dequantise=False)
        assert torch.equal(bits(got["hidden_states"]), bits(want.values))
        assert torch.equal(got["hidden_scales"], want.scales)
    assert verify(b).ok
    sa, sb = summarize(a), summarize(b)
    assert sb["bytes_per_token"] < 0.6 * sa["bytes_per_token"]


def test_trainer_on_fp8_store(two_stores, tmp_path):
    runs = {}
    for name, url in zip(("bf16", "fp8"), two_stores):
        train(build(TrainSettings, store=[url], out=str(tmp_path / name), steps=3, **FAST))
        runs[name] = [json.loads(line)["loss"] for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    assert len(runs["fp8"]) == 3 and all(math.isfinite(x) for x in runs["fp8"])
    # same data, same seed: fp8 features move the loss a little, not a lot
    assert runs["fp8"] != runs["bf16"]
    assert all(abs(f - b) < 0.05 * abs(b) for f, b in zip(runs["fp8"], runs["bf16"]))


def test_wds_layout_refuses_fp8(tmp_path, new_manifest):
    """wds members are plain .npy files read by numpy alone: values, not e4m3 bits needing scales."""
    with pytest.raises(hsstore.ManifestError, match="layout 'wds' holds raw features only"):
        dataclasses.replace(new_manifest(), layout="wds", encoding="fp8")
    raw = (tmp_path / "m.json")
    raw.write_text(json.dumps({**json.loads(new_manifest().to_json()), "layout": "wds", "encoding": "fp8"}))
    with pytest.raises(hsstore.ManifestError, match="layout 'wds' holds raw features only"):
        hsstore.Manifest.from_json(raw.read_text(), "m.json")  # a hand-edited manifest too


def test_numpy_decode_table_equals_torch_conversion():
    """The 256-entry table the numpy form decodes with (made without torch, so that reading commands need none)
    is torch's own float8_e4m3fn -> float32 conversion of every bit pattern, NaN included."""
    ref = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    assert np.array_equal(fp8.decode_bits(np.arange(256, dtype=np.uint8)), ref, equal_nan=True)
    assert fp8.FP8_DTYPE is torch.float8_e4m3fn
