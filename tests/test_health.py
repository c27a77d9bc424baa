"""Feature health (issue #37): statistics in every commit record, and the rules that make bad values loud.

Planted faults, each of which today's checksums pass: a feature zeroed in some samples and a NaN in one (written
through ``StoreWriter``), a record whose statistics lie about the data, a peer's import with a zeroed layer. The
expected statistics are computed here with numpy in float64 from the samples themselves.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib

import numpy as np
import pytest
import torch

import hsstore
from hsstore.app.cli import main

from conftest import make_manifest, make_samples, write_samples
from test_import import IDENTITY, write_speculators

ZEROED, NAN = ("s4", "s5", "s6"), "s2"  # layer 3 is zero in the first, one NaN in layer 1 of the second


def planted(url: str, layout: str = "zarr", record_stats: bool = True) -> list[dict]:
    samples = make_samples(12, max_len=60)
    for s in samples:
        s["loss_mask"][0] = True  # every sample has loss tokens
        if s["sample_id"] in ZEROED:
            s["hidden_states"][:, 1] = 0
        if s["sample_id"] == NAN:
            s["hidden_states"][3, 0, 5] = float("nan")
    m = make_manifest()
    if layout != "zarr":
        m = dataclasses.replace(m, layout=layout)
    write_samples(url, m, samples, check_finite=False, shard_bytes=5 * 60 * 3 * 48 * 2, record_stats=record_stats)
    return samples


def test_record_statistics_are_the_values_statistics(tmp_path):
    url = str(tmp_path / "s")
    samples = planted(url)
    store = hsstore.open(url)
    by_id = {s["sample_id"]: s for s in samples}
    for rec in store.commits:
        feats = rec.stats["features"]
        for j, layer in enumerate(store.manifest.layers):
            x = [by_id[sid]["hidden_states"][:, j].float().numpy().astype(np.float64) for sid in rec.samples["sample_id"]]
            allv = np.concatenate([v.ravel() for v in x])
            finite = allv[np.isfinite(allv)]
            e = feats[str(layer)]
            assert e["count"] == allv.size and e["zeros"] == int((allv == 0).sum())
            assert e["nonfinite"] == int((~np.isfinite(allv)).sum())
            assert e["sum"] == pytest.approx(finite.sum(), rel=1e-5, abs=1e-3)
            assert e["sumsq"] == pytest.approx(np.square(finite).sum(), rel=1e-5)
            assert e["absmax"] == pytest.approx(np.abs(finite).max(), rel=1e-6)
            want_rms = [np.sqrt(np.square(np.where(np.isfinite(v), v, 0)).mean()) for v in x]
            assert e["sample_rms"] == pytest.approx(want_rms, rel=1e-5, abs=1e-7)
            assert e["sample_zeros"] == [int((v == 0).sum()) for v in x]


@pytest.mark.parametrize("layout", ["zarr", "wds"])
def test_verify_fails_naming_the_nan_and_the_zeroed_feature(tmp_path, layout, capsys):
    url = str(tmp_path / "s")
    planted(url, layout)
    assert main(["verify", url, "-q"]) == 1
    fails = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("FAIL")]
    assert any("layer 1: non-finite values (1 of" in f and f"[samples: {NAN}]" in f for f in fails), fails
    zero = [f for f in fails if "layer 3: all zero" in f]
    assert sorted(f.rsplit("[samples: ", 1)[1].rstrip("]") for f in zero) == sorted(ZEROED), fails
    assert len(fails) == 4, fails


def test_verify_fails_a_record_whose_statistics_lie(tmp_path, capsys):
    """A forged record claims the NaN sample is clean: verify counts from the data, so it still FAILs the sample
    and names the record's statistics as disagreeing."""
    url = str(tmp_path / "s")
    planted(url)
    store = hsstore.open(url)
    rec = next(c for c in store.commits if NAN in c.samples["sample_id"])
    path = pathlib.Path(url, "commits", f"{rec.shard}.json")
    d = json.loads(path.read_text())
    d["stats"]["features"]["1"]["sample_nonfinite"] = [0] * rec.n_samples
    d["stats"]["features"]["1"]["nonfinite"] = 0
    path.write_text(json.dumps(d))
    assert main(["verify", url, "-q"]) == 1
    out = capsys.readouterr().out
    assert f"[samples: {NAN}]" in out and "feature statistics of ['1'] disagree with the data" in out, out


def test_info_prints_feature_rms_and_warns(tmp_path, capsys):
    url = str(tmp_path / "s")
    planted(url)
    assert main(["info", url]) == 0
    out = capsys.readouterr().out
    assert "layer 1: rms" in out and "layer 3: rms" in out and "non-finite 1" in out, out
    assert "!!! WARNING: layer 1: 1 non-finite values in 1 sample(s)" in out
    assert "!!! WARNING: layer 3: all zero in 3 sample(s)" in out
    assert main(["info", url, "--json"]) == 0
    h = json.loads(capsys.readouterr().out)["feature_health"]
    assert h["features"]["1"]["nonfinite"] == 1 and h["features"]["3"]["zero_samples"] == 3
    assert set(h["features"]["5"]) >= {"count", "sum", "sumsq", "mean", "rms", "absmax", "zeros", "nonfinite",
                                       "shard_rms", "outlier_shards", "zero_dominated_shards"}


def test_info_names_a_shard_whose_rms_is_10x_off(tmp_path, capsys):
    url = str(tmp_path / "s")
    samples = make_samples(30, min_len=20, max_len=21)  # 20 tokens each, 10 a shard: 3 shards
    for s in samples[20:]:  # the last shard's layer 5 at 100x the scale: the wrong tensor, or unscaled
        s["hidden_states"][:, 2] *= 100
    write_samples(url, make_manifest(), samples, shard_bytes=200 * 3 * 48 * 2)
    assert main(["info", url]) == 0
    out = capsys.readouterr().out
    last = hsstore.open(url).commits[-1].shard
    assert "!!! WARNING: layer 5: RMS of 1 shard(s) more than 10x from the store's median" in out
    assert last in out


def test_train_refuses_an_unhealthy_store_naming_the_flag(tmp_path, capsys):
    url = str(tmp_path / "s")
    planted(url)
    rc = main(["train", "--store", url, "--out", str(tmp_path / "run"), "--steps", "1", "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 2 and "--allow-unhealthy" in err and "train nothing" in err, err
    rc = main(["train", "--store", url, "--out", str(tmp_path / "run2"), "--steps", "1", "--device", "cpu",
               "--allow-unhealthy"])
    err = capsys.readouterr().err
    assert rc == 2 and "--allow-unhealthy" not in err.splitlines()[-1] and "asset" in err, err  # got past the check


def test_subset_exclude_unhealthy_leaves_a_healthy_store(tmp_path, capsys):
    url, dst = str(tmp_path / "s"), str(tmp_path / "d")
    planted(url)
    assert main(["subset", url, dst, "--exclude-unhealthy", "-q"]) == 0
    ids = set(hsstore.open(dst).sample_ids())
    assert ids == {f"s{i}" for i in range(12)} - set(ZEROED) - {NAN}
    assert main(["verify", dst, "-q"]) == 0


@pytest.mark.parametrize("how", [["--layout", "wds"], ["--encoding", "fp8"], ["--encoding", "nvfp4"]])
def test_convert_refuses_a_nan_sample_naming_it_and_keeps_what_it_wrote(tmp_path, capsys, how):
    """A NaN in layer 1 of one sample of the last shard (written with ``check_finite=False``, its record counting
    it): ``convert``, bit-exact or into another encoding, refuses in one line naming the sample and the layer, exit
    2, before writing that shard; the shards before it stay committed and verify, the lock is gone, and a re-run
    resumes to the same refusal (without the check, the copy was written, exit 0, and verify failed it)."""
    url, dst = str(tmp_path / "s"), str(tmp_path / "d")
    samples = make_samples(12, min_len=30, max_len=31)
    samples[10]["hidden_states"][7, 0, 5] = float("inf" if how[-1] == "fp8" else "nan")
    write_samples(url, make_manifest(), samples, check_finite=False, shard_bytes=4 * 30 * 3 * 48 * 2)
    src = hsstore.open(url)
    bad = next(c.shard for c in src.commits if "s10" in c.samples["sample_id"])
    assert len(src.commits) == 3 and bad == src.commits[-1].shard
    for _ in range(2):  # the re-run skips the shards written and refuses the same one
        assert main(["convert", url, dst, *how, "-q"]) == 2
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert len(err) == 1 and "Traceback" not in err[0], err
        assert "'s10'" in err[0] and "layer 1 has NaN/Inf features (first at token 7)" in err[0] and bad in err[0]
        out = hsstore.open(dst)
        assert [c.shard for c in out.commits] == [c.shard for c in src.commits[:2]]
        assert not list(pathlib.Path(dst, "locks").glob("*"))
    assert main(["verify", dst, "-q"]) == 0


def test_import_refuses_a_zeroed_layer_and_keeps_it_flagged_on_request(tmp_path, capsys):
    samples = make_samples(6)
    for s in samples[2:5]:  # the vLLM hybrid-target failure: one layer all zeros
        s["hidden_states"][:, 1] = 0
    write_speculators(tmp_path / "spec", samples)
    out = str(tmp_path / "store")
    rc = main(["import", "speculators", str(tmp_path / "spec"), "--out", out, *IDENTITY])
    err = capsys.readouterr().err
    assert rc == 2 and "3 of 6 samples have an all-zero or non-finite feature" in err, err
    assert "hs_2" in err and "layer 3: all zero" in err and "--keep-unhealthy" in err
    assert len(hsstore.open(out)) == 3  # the healthy ones are kept, nothing lost
    assert main(["import", "speculators", str(tmp_path / "spec"), "--out", out, "--keep-unhealthy", *IDENTITY]) == 0
    store = hsstore.open(out)
    flags = {store.ref(i).sample_id: store.commits[[c.shard for c in store.commits].index(store.ref(i).shard)]
             .samples["flags"][store.ref(i).local] for i in range(len(store))}
    assert {k for k, v in flags.items() if "feature_zero" in v} == {"hs_2", "hs_3", "hs_4"}
    assert main(["subset", out, str(tmp_path / "clean"), "--exclude-flag", "feature_zero", "-q"]) == 0
    assert len(hsstore.open(str(tmp_path / "clean"))) == 3


def test_older_stores_read_and_upgrade_adds_the_statistics(tmp_path, capsys, monkeypatch):
    url = str(tmp_path / "s")
    planted(url, record_stats=False)
    assert all("features" not in c.stats for c in hsstore.open(url).commits)
    assert main(["info", url]) == 0
    assert "without value statistics" in capsys.readouterr().out
    assert main(["verify", url, "-q"]) == 1  # verify counts from the data: no statistics needed
    capsys.readouterr()
    assert main(["upgrade", url]) == 1  # the unhealthy shards are refused (named), the healthy ones upgraded
    out = capsys.readouterr().out
    store = hsstore.open(url)
    have = [c for c in store.commits if "features" in c.stats]
    assert have and all(NAN not in c.samples["sample_id"] for c in have), out
    assert len(have) < len(store.commits)


def test_index_segments_carry_the_statistics(tmp_path):
    url = str(tmp_path / "s")
    planted(url)
    a = hsstore.open(url).table.feature_stats
    b = hsstore.Store(url, use_index=False).table.feature_stats
    assert a is not None and np.array_equal(a, b, equal_nan=True)
    assert main(["index", url, "--grace", "0"]) == 0
    c = hsstore.open(url).table.feature_stats
    assert np.array_equal(a, c, equal_nan=True)


def test_report_draws_rms_per_shard_with_the_outlier_red(tmp_path):
    from hsstore.ops.html_report import MARK, store_html

    url = str(tmp_path / "s")
    samples = make_samples(30, min_len=20, max_len=21)
    for s in samples[20:]:
        s["hidden_states"][:, 2] *= 100
    write_samples(url, make_manifest(), samples, shard_bytes=200 * 3 * 48 * 2)
    page = store_html(hsstore.open(url))
    import re

    chart = re.search(r'<svg class="chart" data-chart="rms_5".*?</svg>', page, re.S).group(0)
    bars = re.findall(r'<rect class="mark bar"[^>]*fill="([^"]+)"', chart)
    assert bars == [bars[0], bars[0], MARK] and bars[0] != MARK, bars
    other = re.search(r'<svg class="chart" data-chart="rms_1".*?</svg>', page, re.S).group(0)
    assert MARK not in re.findall(r'<rect class="mark bar"[^>]*fill="([^"]+)"', other)


def test_device_statistics_of_an_fp8_batch_count_what_the_store_holds(tmp_path, capsys):
    """Extraction's statistics of an fp8 batch (``batch_stats`` with the scales) agree with what ``verify`` counts in
    the stored e4m3 values: a token with one large entry gets a large scale, and its small entries round to zero
    there (an H200 extraction's store failed verify when the statistics were taken before quantising)."""
    from hsstore.format import fp8, health

    m = dataclasses.replace(make_manifest(), encoding="fp8")
    samples = make_samples(4, max_len=40)
    lengths = [s["hidden_states"].shape[0] for s in samples]
    packed = torch.cat([s["hidden_states"].float() for s in samples])  # [tokens, layers, H]
    packed[::3, :, 0] = 1e4  # every third token: scale 1e4 / 448, so entries below ~0.04 store as 0
    q = fp8.quantise(packed)
    want_zeros = (q.values.float() == 0).sum(dim=(0, 2))  # what the store will hold, counted independently
    assert int(want_zeros.sum()) > 0 and int((packed == 0).sum()) == 0
    stats = health.batch_stats(q.values, lengths, q.scales)
    assert torch.equal(stats[:, :, 3].sum(0), want_zeros.float())
    deq = q.values.float() * q.scales.unsqueeze(-1)
    assert torch.allclose(stats[:, :, 1].sum(0).double(), deq.double().square().sum(dim=(0, 2)), rtol=1e-4)
    url = str(tmp_path / "fp8")
    w = hsstore.StoreWriter(url, m)
    start = 0
    for s, n, st in zip(samples, lengths, stats):
        w.add(s["sample_id"], s["input_ids"], s["loss_mask"],
              fp8.Quantised(q.values[start:start + n], q.scales[start:start + n]), feature_stats=st.numpy())
        start += n
    w.close()
    assert main(["verify", url, "-q"]) == 0, capsys.readouterr().out
