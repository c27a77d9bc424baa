"""`hsstore check`'s cost estimate: the sizes it predicts are those of the stores extraction then writes, and the
seeds' workload (914K conversations, 1.87B tokens, taps [1,16,31,46,61] of a 5120-wide target) comes out as the
format's per-token sizes say."""

import json

import pytest

import hsstore
from hsstore.app.cli import main
from hsstore.ops.estimate import RECOMMENDED, REFERENCE_TOKENS_PER_S, SIZED, estimate, storage_month_usd
from hsstore.extract.job import ExtractSettings, run_extract
from hsstore.app.schema import build
from train_helpers import small_input  # noqa: F401  (fixture)


def test_seed_workload():
    e = estimate(samples=914_000, tokens=1_870_000_000, layers=[1, 16, 31, 46, 61], hidden=5120)
    # FORMAT.md: bf16 features 2 B per value, fp8 1 B per value + float32 scale per token and layer; input_ids
    # int32 + loss_mask uint8 per token; BRIEF: 51,200 B/token for 5 x 5120 bf16
    # nvfp4 (FORMAT.md): per row 2,560 B of codes, 320 e4m3 block scales, a float32 row scale and 10 outlier slots of
    # 4 B; mxfp4: 2,560 B of codes, 160 E8M0 block scales and the same 10 slots; mxfp6: 3,840 B of codes, 160, 10
    assert e["bytes_per_token"] == {"bf16": 51_200 + 5, "fp8": 5 * (5120 + 4) + 5, "mxfp6": 5 * 4040 + 5,
                                    "nvfp4": 5 * 2924 + 5, "mxfp4": 5 * 2760 + 5}
    assert e["data_bytes"]["nvfp4"] * 3.5 < e["data_bytes"]["bf16"]  # the goal: 3.5x under bf16, scales included
    assert e["data_bytes"]["bf16"] == 1_870_000_000 * 51_205  # 95.75 TB
    assert e["data_bytes"]["bf16_final_hidden"] == 1_870_000_000 * (61_440 + 5)
    assert e["store_bytes"]["bf16"] == pytest.approx(e["data_bytes"]["bf16"] * 1.038, rel=0.01)  # chunk padding
    assert e["gpu_hours"] == pytest.approx(1.87e9 / 11_049 / 3600)  # 47.0 H200-hours
    assert e["epoch_read_bytes"]["fp8"] == e["data_bytes"]["fp8"]
    # a month in S3 Standard, tiered: 50 TB at $0.023 per GB-month, the next 450 TB at $0.022
    tb = 1 << 40
    assert storage_month_usd(50 * tb) == pytest.approx(50 * 1024 * 0.023)
    assert storage_month_usd(60 * tb) == pytest.approx(50 * 1024 * 0.023 + 10 * 1024 * 0.022)
    assert e["storage_month_usd"]["bf16"] == pytest.approx(storage_month_usd(e["store_bytes"]["bf16"]))
    assert e["recommended"]["encoding"] == RECOMMENDED


def test_check_estimate_matches_the_extracted_stores(tiny_dir, small_input, tmp_path, capsys):  # noqa: F811
    assert main(["check", "--model", str(tiny_dir), "--input", str(small_input), "--json", "--tokens-per-s",
                 "1000", "--layers", "1,3,5"]) in (0, 1)
    est = json.loads(capsys.readouterr().out)["estimate"]
    assert est["layers"] == [1, 3, 5] and est["tokens_per_s"] == 1000
    assert est["gpu_hours"] == pytest.approx(est["tokens"] / 1000 / 3600)
    for key, encoding in SIZED.items():
        out = tmp_path / encoding
        run_extract(build(ExtractSettings, model=str(tiny_dir), input=[str(small_input)], out=str(out), layers=[1, 3,
                          5], device="cpu", encoding=encoding, progress=False, force=True))
        store = hsstore.open(str(out))
        assert len(store) == est["samples"]
        # what the store holds for each sample, read back as stored (fp8: e4m3 values + float32 scales; nvfp4 and
        # mxfp4: their rows' bytes)
        held = 0
        for i in range(len(store)):
            item = store.read(i, dequantise=False)
            held += sum(item[k].numel() * item[k].element_size() for k in ("hidden_states", "hidden_scales")
                        if k in item)
            held += len(item["input_ids"]) * (4 + 1)  # FORMAT.md: input_ids int32, loss_mask uint8
        assert held == est["data_bytes"][key]
        on_disk = int(store.table.ints["stored_bytes"].sum())  # every shard file, as the commit records list them
        chunk = store.commits[0].chunk_tokens  # one shard: its last chunks are padded to full size
        assert est["data_bytes"][key] < on_disk <= est["data_bytes"][key] + chunk * est["bytes_per_token"][key] * 1.1


def test_estimate_only_flag(capsys):
    assert main(["check", "--estimate-only", "--tokens", "1.87e9", "--samples", "914000", "--hidden", "5120",
                 "--layers", "1,16,31,46,61"]) == 0
    text = capsys.readouterr().out
    assert "99.4" in text and "47.0 GPU-hours" in text and f"{REFERENCE_TOKENS_PER_S:,.0f}" in text
    assert main(["check", "--estimate-only", "--tokens", "10"]) == 2


@pytest.fixture(scope="module")
def shallow_dir():
    """A real tiny Qwen3.5 target of 4 layers: too shallow for DFlash's 5 default taps."""
    from hsstore.extract.tiny import tiny_target_dir

    return tiny_target_dir(num_layers=4)


@pytest.mark.parametrize("data", ["small_input", "stub_file"])
def test_check_on_a_shallow_target_keeps_the_gate_verdict(shallow_dir, data, request, capsys):
    """The estimate cannot choose 5 taps of 4 layers: it says so in one line naming --layers and is left out; the
    gate's report is printed and its verdict is the exit code (0 for the demo rows, 1 for the stub-dominated ones)."""
    from transformers import AutoTokenizer

    from hsstore.extract.gate import GateThresholds
    from hsstore.extract.gate_report import gate_inputs

    path = str(request.getfixturevalue(data))
    gate_ok = gate_inputs([path], AutoTokenizer.from_pretrained(shallow_dir), thresholds=GateThresholds()).ok
    assert gate_ok == (data == "small_input")
    rc = main(["check", "--model", str(shallow_dir), "--input", path])
    out, err = capsys.readouterr()
    assert rc == (0 if gate_ok else 1)
    assert f"hsstore quality gate: {'PASS' if gate_ok else 'FAIL'}" in out and "loss-mask sum" in out
    lines = [line for line in out.splitlines() if line.startswith("estimate")]
    assert lines == ["estimate omitted: a 4-layer target has too few layers for 5 DFlash taps (evenly spaced over "
                     "1..1); give --layers L,L to estimate"]
    assert "cost estimate" not in out and "error" not in err
    assert ("gate failed" in err) == (not gate_ok)

    rc = main(["check", "--model", str(shallow_dir), "--input", path, "--json"])
    d = json.loads(capsys.readouterr().out)
    assert rc == (0 if gate_ok else 1) and d["ok"] == gate_ok
    assert d["estimate"] is None and "give --layers" in d["estimate_omitted"]

    rc = main(["check", "--model", str(shallow_dir), "--input", path, "--json", "--layers", "1,2"])  # what it needs
    d = json.loads(capsys.readouterr().out)
    assert rc == (0 if gate_ok else 1) and d["estimate"]["layers"] == [1, 2] and "estimate_omitted" not in d
    # --estimate-only has nothing but the estimate: there the missing taps stay an error (exit 2)
    assert main(["check", "--estimate-only", "--model", str(shallow_dir), "--tokens", "10", "--samples", "1"]) == 2
    assert "give --layers" in capsys.readouterr().err
