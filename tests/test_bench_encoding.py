"""``hsstore bench --encoding``: the synthetic store in a smaller feature encoding, the same bf16 samples, so that a
source bench of raw and one of nvfp4 read the same tokens and compare per token (bytes per token from docs/FORMAT.md's
definitions, computed here, not asked of the encodings' code)."""

from __future__ import annotations

import json

import pytest

from hsstore.app.cli import main

from test_bad_inputs import one_line_error

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")

H, TAPS = 512, 2


def row_bytes(encoding: str, hidden: int) -> int:
    """Stored bytes of one row (one token of one tap), as docs/FORMAT.md defines them."""
    if encoding == "raw":
        return 2 * hidden  # bf16
    if encoding == "fp8":
        return hidden + 4  # e4m3 values + a float32 row scale
    assert encoding == "nvfp4"
    n, k = -(-hidden // 16), hidden // 512  # blocks of 16, one outlier slot per 512 channels
    return 8 * n + n + 4 + 4 * k  # codes, e4m3 block scales, float32 row scale, outlier indices and values


def source_bench(tmp_path, capsys, encoding: str) -> dict:
    assert main(["bench", str(tmp_path / encoding), "--what", "source", "--procs", "2", "--size-mb", "8",
                 "--hidden", str(H), "--num-taps", str(TAPS), "--epochs", "1", "--encoding", encoding,
                 "--json", "--quiet"]) == 0
    return json.loads(capsys.readouterr().out)["source"]


@pytest.mark.slow
def test_source_bench_reads_the_same_tokens_in_the_encodings_bytes(tmp_path, capsys):
    """raw, fp8 and nvfp4 stores of the same samples: the same tokens, each rank handing over the encoding's
    stored bytes (codes and scales), reported per token beside tokens/s and CPU-seconds per million tokens."""
    runs = {e: source_bench(tmp_path, capsys, e) for e in ("raw", "fp8", "nvfp4")}
    tokens = runs["raw"]["tokens"]
    assert tokens > 0
    for e, r in runs.items():
        per_token = TAPS * row_bytes(e, H)
        assert r["encoding"] == e and r["tokens"] == tokens
        assert r["feature_bytes_per_token"] == per_token and r["bytes"] == tokens * per_token
        for ep in r["epochs"]:
            assert ep["tokens"] == tokens and ep["bytes"] == r["bytes"]
            assert len(ep["per_rank_tokens_per_s"]) == 2
            assert 0 < ep["min_rank_tokens_per_s"] <= max(ep["per_rank_tokens_per_s"])
            assert ep["tokens_per_s"] > 0 and ep["cpu_s_per_mtok"] > 0
            # GB/s counts the bytes handed over: tokens/s times the encoding's bytes per token
            assert ep["total_gbps"] == pytest.approx(ep["tokens_per_s"] * per_token / 1e9)
            assert ep["raw"]["read"]["bytes"] == r["stored_bytes"]  # plain reads of this store's own files
    for e in ("fp8", "nvfp4"):
        factor = row_bytes("raw", H) / row_bytes(e, H)
        smaller = runs["raw"]["stored_bytes_per_token"] / runs[e]["stored_bytes_per_token"]
        assert 0.9 * factor < smaller <= factor  # ids, masks and records are the same in both stores
    assert all(list((tmp_path / e).iterdir()) == [] for e in runs)  # the scratch stores are removed


@pytest.mark.slow
def test_store_bench_writes_the_encoding(tmp_path, capsys):
    """The store bench writes and reads an nvfp4 store of the same bf16 bytes: its files are the smaller ones."""
    def run(encoding: str) -> dict:
        assert main(["bench", str(tmp_path), "--size-mb", "2", "--hidden", str(H), "--num-taps", str(TAPS),
                     "--rounds", "1", "--encoding", encoding, "--json", "--quiet"]) == 0
        return json.loads(capsys.readouterr().out)

    raw, nvfp4 = run("raw"), run("nvfp4")
    for k in ("store_write", "store_read"):
        assert raw[k]["encoding"] == "raw" and nvfp4[k]["encoding"] == "nvfp4"
        assert nvfp4[k]["bytes"] == raw[k]["bytes"]  # the same bf16 samples
        factor = row_bytes("raw", H) / row_bytes("nvfp4", H)
        assert 0.9 * factor < raw[k]["stored_bytes"] / nvfp4[k]["stored_bytes"] <= factor


def test_bench_unknown_encoding(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:  # argparse's refusal, as every command's flag choices
        main(["bench", str(tmp_path / "b"), "--what", "source", "--size-mb", "1", "--hidden", "64",
              "--encoding", "nvfp5", "-q"])
    one_line_error(capsys, e.value.code, r"--encoding: invalid choice: 'nvfp5'")
    assert e.value.code == 2 and not (tmp_path / "b").exists()


def test_loader_bench_refuses_an_encoding(tmp_path, capsys):
    """The loader bench counts bf16 bytes against the peers' bf16 files: an encoding is refused, not mismeasured."""
    rc = main(["bench", str(tmp_path / "b"), "--what", "loader", "--size-mb", "1", "--hidden", "64",
               "--encoding", "nvfp4", "-q"])
    one_line_error(capsys, rc, r"--encoding nvfp4: the loader bench .* --what source")
    assert rc == 2 and not (tmp_path / "b").exists()
