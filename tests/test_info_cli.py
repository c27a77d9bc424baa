"""`hsstore info` (from commit records only), the CLI surface, and the bench's report shape."""

import json

import pytest
import torch

import hsstore
from hsstore.app.cli import main
from hsstore.io.storage import parse_storage_options
from train_helpers import small_input, store32  # noqa: F401  (fixtures)


def test_info_empty_store(tmp_path, new_manifest, capsys):
    hsstore.StoreWriter(str(tmp_path), new_manifest()).close()
    assert main(["info", str(tmp_path), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["samples"] == 0 and d["shards"] == 0 and d["top_loss_sum"] is None
    assert main(["info", str(tmp_path)]) == 0
    assert "empty store" in capsys.readouterr().out


def test_info_makes_stub_signature_loud(tmp_path, new_manifest, new_samples, write, capsys):
    """87% of samples with a loss-mask sum of exactly 6: the brief's failure must jump out."""
    samples = new_samples(100, min_len=20, max_len=60)
    for i, s in enumerate(samples):
        m = torch.zeros_like(s["loss_mask"])
        if i < 87:
            m[-6:] = True
        else:
            m[5:] = True
        s["loss_mask"] = m
    write(str(tmp_path), new_manifest(), samples)
    assert main(["info", str(tmp_path), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["top_loss_sum"]["value"] == 6 and d["top_loss_sum"]["share"] == pytest.approx(0.87)
    assert d["stub_warning"] is True
    assert d["samples"] == 100 and d["tokens"] == sum(s["input_ids"].numel() for s in samples)
    assert d["loss_tokens"] == sum(int(s["loss_mask"].sum()) for s in samples)
    assert d["layers"] == [1, 3, 5] and d["hidden_size"] == 48
    assert d["bytes_per_layer"]["3"]["raw_bytes"] == d["tokens"] * 48 * 2
    assert 0.9 < d["compression_ratio"] <= 1.0  # codec none: only chunk padding, CRCs and metadata
    assert main(["info", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "WARNING: 87.0% of samples have a loss-mask sum of exactly 6" in text
    assert "<-- top value" in text


def test_info_clean_store_no_warning(tmp_path, new_manifest, new_samples, write, capsys):
    write(str(tmp_path), new_manifest(), new_samples(30, min_len=50, max_len=400))
    assert main(["info", str(tmp_path), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["stub_warning"] is False
    assert set(d["length_percentiles"]) == {"p0", "p10", "p50", "p90", "p99", "p100"}


def test_info_reads_no_feature_data(tmp_path, new_manifest, new_samples, write, monkeypatch):
    write(str(tmp_path), new_manifest(), new_samples(10))
    import builtins

    real_open = builtins.open
    opened = []
    monkeypatch.setattr(builtins, "open", lambda p, *a, **k: (opened.append(str(p)), real_open(p, *a, **k))[1])
    from hsstore.ops.info import summarize

    summarize(hsstore.open(str(tmp_path)))
    assert not [p for p in opened if "/shards/" in p]


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert main(["info", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hsstore info: error:") and "does not exist" in err and "\n" not in err


def test_info_on_s3_with_storage_option(s3_store, new_manifest, new_samples, write, capsys):
    url, opts = s3_store
    write(url, new_manifest(), new_samples(5), storage_options=opts)
    assert main(["info", url, "--json", "--storage-option", f"endpoint_url={opts['endpoint_url']}"]) == 0
    assert json.loads(capsys.readouterr().out)["samples"] == 5
    assert main(["verify", url, "-q", "-S", f"endpoint_url={opts['endpoint_url']}"]) == 0


def test_parse_storage_options():
    assert parse_storage_options(["anon=true", "endpoint_url=http://x:1", "client_kwargs.region_name=eu",
                                  "max_concurrency=4"]) == {
        "anon": True, "endpoint_url": "http://x:1", "client_kwargs": {"region_name": "eu"}, "max_concurrency": 4}
    with pytest.raises(hsstore.StoreError, match="expected key=value"):
        parse_storage_options(["anon"])


def test_bench_reports_ratios(tmp_path, capsys):
    assert main(["bench", str(tmp_path), "--size-mb", "4", "--hidden", "256", "--num-taps", "2", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    for k in ("store_write", "store_read"):
        assert {"gbps", "raw_gbps", "ratio"} <= set(d[k]) and d[k]["gbps"] > 0 and d[k]["raw_gbps"] > 0
        assert d[k]["ratio"] == pytest.approx(d[k]["gbps"] / d[k]["raw_gbps"])
    assert list(tmp_path.iterdir()) == []  # scratch removed


def test_info_into_a_closed_pipe_is_quiet(tmp_path):
    """`hsstore info URL | head` must not end with a Broken pipe error: the reader left, nothing failed."""
    import subprocess
    import sys

    from conftest import make_manifest, make_samples, write_samples

    store = tmp_path / "s"
    write_samples(str(store), make_manifest(), make_samples(2))
    err = tmp_path / "err.txt"
    # `true` exits at once, long before the interpreter prints: every write hits a closed pipe
    script = f"{sys.executable} -m hsstore info {store} 2>{err} | true; echo ${{PIPESTATUS[0]}}"
    rc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120).stdout.strip()
    assert err.read_text() == "" and rc == "141"


def test_help_loads_neither_torch_nor_zarr():
    """`hsstore --help` (and every command that never reads a store) starts without the heavy imports."""
    import subprocess
    import sys

    code = ("import sys\nfrom hsstore.app.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('torch', 'zarr', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    assert out.strip().splitlines()[-1] == "[]"
    import hsstore

    assert hsstore.StoreWriter.__name__ == "StoreWriter"
    assert all(hasattr(hsstore, name) for name in hsstore.__all__)


def test_verify_checks_assets_and_says_when_there_are_none(tmp_path, capsys):
    from conftest import make_manifest, make_samples, write_samples

    from hsstore.format import assets
    from hsstore.app.cli import main

    store = tmp_path / "s"
    write_samples(str(store), make_manifest(), make_samples(2))
    assert main(["verify", str(store), "--quiet"]) == 0
    assert "the store has no assets" in capsys.readouterr().out
    s = hsstore.open(str(store))
    assets.write_assets(s.fs, s.root, {"config.json": b'{"a": 1}', "tokenizer/tokenizer.json": b"{}"})
    assert main(["verify", str(store), "--quiet"]) == 0
    assert "no assets" not in capsys.readouterr().out
    (store / "assets" / "config.json").write_bytes(b'{"a": 2}')  # same size, other bytes
    (store / "assets" / "tokenizer" / "tokenizer.json").unlink()
    assert main(["verify", str(store), "--quiet"]) == 1
    out = capsys.readouterr().out
    assert "FAIL shard (assets), file assets/config.json" in out and "does not match its checksum" in out
    assert "FAIL shard (assets), file assets/tokenizer/tokenizer.json: listed in assets/index.json but missing" in out


NO_TORCH_RUNNER = ("import sys\nfrom hsstore.app.cli import main\nrc = main(sys.argv[1:])\n"
                   "print('torch imported' if 'torch' in sys.modules else 'no torch', rc)")


@pytest.mark.parametrize("encoding", ["raw", "fp8"])
def test_store_commands_never_import_torch(tmp_path, encoding):
    """#38.5: info, verify, index, subset, merge and report read metadata or copy stored bits: each runs, in a
    fresh interpreter, to its end without torch (17 of the 17.6 s that `info` took to start on a busy machine)."""
    import dataclasses
    import subprocess
    import sys

    from conftest import make_manifest, make_samples, write_samples

    from hsstore.format import assets

    store = tmp_path / "s"
    write_samples(str(store), dataclasses.replace(make_manifest(), encoding=encoding), make_samples(6))
    s = hsstore.open(str(store))
    assets.write_assets(s.fs, s.root, {"config.json": b'{"a": 1}'})  # subset and merge copy them
    runs = [["info", str(store)], ["verify", str(store), "-q"], ["index", str(store)],
            ["subset", str(store), str(tmp_path / "sub"), "--min-length", "50", "-q"],
            ["merge", str(tmp_path / "merged"), str(store), "-q"],
            ["report", str(store), "--out", str(tmp_path / "r.html")]]
    for argv in runs:
        p = subprocess.run([sys.executable, "-c", NO_TORCH_RUNNER, *argv], capture_output=True, text=True,
                           timeout=300)
        assert p.stdout.strip().splitlines()[-1] == "no torch 0", (argv, p.stdout[-500:], p.stderr[-2000:])
    sub, src = hsstore.open(str(tmp_path / "sub")), hsstore.open(str(store))
    assert 0 < len(sub) < len(src)
    for i in range(len(sub)):  # subset copied the stored bits: values (and fp8 scales) bit for bit
        a = sub.read(i, dequantise=False)
        b = src.read(src.sample_ids().index(a["sample_id"]), dequantise=False)
        assert torch.equal(a["hidden_states"].contiguous().view(torch.uint8),
                           b["hidden_states"].contiguous().view(torch.uint8))
        if encoding == "fp8":
            assert torch.equal(a["hidden_scales"], b["hidden_scales"])


def test_info_ratios_agree_with_the_figures_beside_them(tmp_path, capsys):
    """#38.12: each ratio `info` prints is the quotient of the two figures printed beside it, labelled (it used
    to divide raw features by the features' stored bytes while printing every file's bytes beside it)."""
    import re

    from conftest import make_manifest, make_samples, write_samples

    from hsstore.ops.info import human_bytes, summarize

    store = tmp_path / "s"
    write_samples(str(store), make_manifest(codec="zstd"), make_samples(30))
    assert main(["info", str(store)]) == 0
    out = capsys.readouterr().out
    s = summarize(hsstore.open(str(store)))
    assert s["stored_bytes"] > s["feature_stored_bytes"]  # ids, masks and metadata are files too
    every = re.search(r"bytes +(\S+ \S+) stored in all: features (\S+ \S+), token ids, masks and metadata (\S+ \S+)", out)
    assert every.groups() == (human_bytes(s["stored_bytes"]), human_bytes(s["feature_stored_bytes"]),
                              human_bytes(s["stored_bytes"] - s["feature_stored_bytes"]))
    lines = re.findall(r"(\d+\.\d) (KB|MB) raw / (\d+\.\d) (KB|MB) stored = (\d+\.\d\d)x", out)
    assert len(lines) == 1 + 3  # the features in all, then each layer
    unit = {"KB": 1e3, "MB": 1e6}
    for raw, ru, stored, su, ratio in lines:  # the ratio is what the figures beside it give, to their rounding
        assert float(ratio) == pytest.approx(float(raw) * unit[ru] / (float(stored) * unit[su]), rel=0.02)
    assert float(lines[0][4]) == pytest.approx(s["raw_feature_bytes"] / s["feature_stored_bytes"], abs=0.005)
    assert "raw / stored" in out


def test_info_counts_the_writer_sessions_of_a_merge(tmp_path, new_manifest, new_samples, write, capsys):
    """Two extractions (each rank tagged rank00000, as extract tags them) merged into one store: info says two
    writers, not one."""
    m = new_manifest()
    write(str(tmp_path / "a"), m, new_samples(4, prefix="a"), writer_tag="rank00000")
    write(str(tmp_path / "b"), m, new_samples(4, prefix="b", seed=1), writer_tag="rank00000")
    assert main(["merge", str(tmp_path / "both"), str(tmp_path / "a"), str(tmp_path / "b"), "-q"]) == 0
    capsys.readouterr()
    for url, n in ((tmp_path / "a", 1), (tmp_path / "both", 2)):
        assert main(["info", str(url), "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["writers"] == n
    assert main(["info", str(tmp_path / "both")]) == 0
    assert "in 2 shards from 2 writer session(s)" in capsys.readouterr().out


def test_check_and_info_give_the_same_percentiles(tiny_dir, store32, small_input, capsys):  # noqa: F811
    """The store extracted from an input and `check` of that input: the same loss-mask sums, so the same
    percentiles, each a value some sample has (one function computes both)."""
    assert main(["info", store32, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    main(["check", "--model", str(tiny_dir), "--input", str(small_input), "--json"])
    check = json.loads(capsys.readouterr().out)
    assert info["samples"] == check["samples"] == 8
    ours, theirs = info["loss_sum_percentiles"], check["loss_sum_percentiles"]
    assert {k: ours[k] for k in theirs if k in ours} == {k: theirs[k] for k in ours if k in theirs}
    assert set(ours) & set(theirs) >= {"p0", "p10", "p50", "p90", "p99", "p100"}
    store = hsstore.open(store32)
    sums = set(store.table.samples["loss_tokens"].tolist())
    lengths = set(store.table.samples["length"].tolist())
    assert set(ours.values()) <= sums and set(info["length_percentiles"].values()) <= lengths
