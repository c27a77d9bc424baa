"""The encodings below fp8 through every command, on the tiny target: ``extract --encoding`` (the writer process
too), ``info``, ``verify``, ``show``, ``audit`` (each encoding's bound), ``export`` (values decoded into what the peers
read), ``convert --encoding`` between all encodings, ``subset``, ``train`` (bytes cross, decoded after the copy) and
``eval``. Each store is compared with a bf16 extraction of the same conversations in the same batches, whose forward
is the same bit for bit: an encoded store holds exactly the encoding of the bf16 store's values."""

import json

import pytest
import torch

import hsstore
from hsstore.app.cli import main
from hsstore.extract.job import ExtractSettings, run_extract
from hsstore.extract.tiny import demo_conversations_path, tiny_target_dir
from hsstore.app.schema import build
from hsstore.format import codec, encodings
from hsstore.train.trainer import TrainSettings, train
from train_helpers import FAST

pytestmark = pytest.mark.slow  # extraction, audit and training on the tiny target

LAYERS = [1, 4, 7]
BLOCK = ("mxfp6", "nvfp4", "mxfp4")


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """The same six conversations extracted in bf16 (API) and in each block encoding (CLI; nvfp4 through the writer
    process, its bytes through the shared-memory staging), same batching."""
    root = tmp_path_factory.mktemp("enc")
    rows = root / "in.jsonl"
    rows.write_text("\n".join(demo_conversations_path().read_text().splitlines()[:6]) + "\n")
    model = str(tiny_target_dir())
    out = {"raw": str(root / "raw")}
    run_extract(build(ExtractSettings, model=model, input=[str(rows)], out=out["raw"], device="cpu", layers=LAYERS,
                      token_budget=700, progress=False))
    for name in BLOCK:
        out[name] = str(root / name)
        writer = ["--writer", "process"] if name == "nvfp4" else []
        assert main(["extract", "--model", model, "--input", str(rows), "--out", out[name], "--device", "cpu",
                     "--layers", ",".join(map(str, LAYERS)), "--token-budget", "700", "--encoding", name, "-q",
                     *writer]) == 0
    return out


def decoded_values(url: str) -> dict[str, torch.Tensor]:
    s = hsstore.open(url)
    return {x["sample_id"]: x["hidden_states"] for x in s}


@pytest.mark.parametrize("name", BLOCK)
def test_extract_holds_the_encoded_bf16_features(stores, name):
    bf16, store = hsstore.open(stores["raw"]), hsstore.open(stores[name])
    enc = encodings.get(name)
    index = {sid: i for i, sid in enumerate(bf16.sample_ids())}
    for i, sid in enumerate(store.sample_ids()):
        want = enc.encode(bf16.read(index[sid])["hidden_states"]).values
        assert torch.equal(store.read(i, dequantise=False)["hidden_states"], want)


@pytest.mark.parametrize("name", BLOCK)
def test_info_verify_show(stores, name, capsys):
    url = stores[name]
    m = hsstore.open(url).manifest
    assert main(["info", url, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["encoding"] == name
    assert info["dtype_bytes_per_token"] == 2 * len(LAYERS) * m.hidden_size
    # the stored bytes (chunk padding included) are at least the encoding's and under a third of bf16's here
    assert codec.token_bytes(m.dtype, name, len(LAYERS), m.hidden_size) <= info["bytes_per_token"]
    assert info["feature_health"]["features"]["1"]["rms"] > 0
    assert main(["verify", url, "-q"]) == 0
    assert main(["show", url, "0"]) == 0
    assert "<|im_start|>" in capsys.readouterr().out


@pytest.mark.parametrize("name", BLOCK)
def test_audit_holds_each_encodings_bound(stores, name, capsys):
    assert main(["audit", stores[name], "--model", str(tiny_target_dir()), "--device", "cpu", "-q", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["encoding"] == name and name in report["bound"]["why"]
    assert report["bound"]["floor"] == encodings.get(name).floor
    for v in report["features"].values():
        # 6- and 4-bit values: far from bit-exact, yet within the encoding's floor
        assert v["ok"] and 1 - v["min_cosine"] < encodings.get(name).floor and v["max_rel_err"] > 0.005


@pytest.mark.parametrize("name", BLOCK)
def test_export_gives_the_peers_decoded_values(stores, name, tmp_path):
    url = stores[name]
    values = decoded_values(url)
    assert main(["export", "specforge", url, str(tmp_path / "sf"), "-q"]) == 0
    sidecar = json.loads((tmp_path / "sf" / "hsstore_export.json").read_text())
    assert sidecar["encoding"] == name
    for i, sid in enumerate(sidecar["sample_ids"]):
        rec = torch.load(next((tmp_path / "sf").glob(f"rows_*/data_{i}.ckpt")), weights_only=True)
        T = values[sid].shape[0]
        assert rec["hidden_states"].dtype == torch.bfloat16
        assert torch.equal(rec["hidden_states"], values[sid].reshape(1, T, -1))


def test_convert_between_every_encoding(stores, tmp_path):
    """nvfp4 -> each other encoding -> back: every store verifies, each holds the encoding of what it was
    converted from (decoded into the manifest dtype); the layout stays, so the values alone change."""
    src = stores["nvfp4"]
    here = decoded_values(src)
    for name in encodings.NAMES:
        if name == "nvfp4":
            continue
        dst = str(tmp_path / name)
        assert main(["convert", src, dst, "--encoding", name, "-q"]) == 0
        assert main(["verify", dst, "-q"]) == 0
        d = hsstore.open(dst)
        assert d.manifest.encoding == name and d.manifest.layout == "zarr"
        enc = encodings.get(name)
        for sid, x in decoded_values(dst).items():
            want = x if name == "raw" else enc.decode(*enc.encode(here[sid]), x.shape[-1], torch.bfloat16)
            assert torch.equal(x, here[sid] if name == "raw" else want), name
        back = str(tmp_path / f"{name}-back")
        assert main(["convert", dst, back, "--encoding", "nvfp4", "-q"]) == 0
        if name in ("raw", "fp8"):  # fp8 keeps far more than nvfp4: re-encoding lands on nvfp4's values again
            got = decoded_values(back)
            agree = sum(int(torch.equal(got[s], here[s])) for s in here)
            assert agree >= (len(here) if name == "raw" else 1)
    assert main(["convert", src, str(tmp_path / "w"), "--layout", "wds", "-q"]) == 2  # wds holds raw features only


def test_subset_copies_the_bytes(stores, tmp_path):
    src = stores["mxfp4"]
    sub = str(tmp_path / "sub")
    assert main(["subset", src, sub, "--fraction", "0.5", "--seed", "1", "-q"]) == 0
    a, b = hsstore.open(src), hsstore.open(sub)
    index = {sid: i for i, sid in enumerate(a.sample_ids())}
    assert 0 < len(b) < len(a)
    for i, sid in enumerate(b.sample_ids()):
        assert torch.equal(b.read(i, dequantise=False)["hidden_states"],
                           a.read(index[sid], dequantise=False)["hidden_states"])
    assert main(["verify", sub, "-q"]) == 0


def test_train_and_eval_on_a_block_store(stores, tmp_path, capsys):
    """The trainer reads nvfp4 bytes, decodes them after the copy, and learns about as it does from bf16."""
    runs = {}
    for name in ("raw", "nvfp4"):
        train(build(TrainSettings, store=[stores[name]], out=str(tmp_path / name), steps=3, **FAST))
        runs[name] = [json.loads(line)["loss"] for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    assert len(runs["nvfp4"]) == 3 and runs["nvfp4"] != runs["raw"]
    assert all(abs(f - b) < 0.1 * abs(b) for f, b in zip(runs["nvfp4"], runs["raw"]))
    assert main(["eval", "--store", stores["nvfp4"], "--drafter", str(tmp_path / "nvfp4"), "--device", "cpu",
                 "--json", "-q"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["anchors"] > 0 and 1 <= report["tau"] <= 8


def test_seeds_shape_mode_runs_small_on_the_cpu(tmp_path):
    """tools/encoding_evidence.py --seeds-shape (the GPU run at 64 layers x 5,120) runs small on the CPU: each
    encoding's error per tap with outliers planted; the outlier slots keep the other channels' error where it is
    without the outliers, and without slots it grows."""
    from tools.encoding_evidence import main as evidence

    out = tmp_path / "seeds.json"
    assert evidence(["--seeds-shape", "--device", "cpu", "--layers-total", "8", "--hidden", "1024", "--ffn", "1024",
                     "--heads", "4", "--kv-heads", "2", "--head-dim", "64", "--linear-k-heads", "2",
                     "--linear-v-heads", "4", "--vocab", "4096", "--samples", "2", "--min-len", "64", "--max-len",
                     "96", "--outliers", "2", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["shape"]["taps"] == [1, 2, 3, 4, 5] and len(res["outliers"]["channels"]) == 2
    for name in BLOCK:
        e = res["encodings"][name]
        assert e["bytes_per_token"] == 5 * encodings.get(name).width(1024) and e["decode_gb_s"] > 0
        for tap in e["per_tap"].values():
            assert tap["others"]["rel"] < 1.05 * tap["without_outliers"]["rel"]
            assert tap["others_no_slots"]["rel"] > 1.2 * tap["others"]["rel"]
