"""`hsstore audit`: a store's features recomputed by the target's eager forward on a few samples (issue #37).

Planted faults, each of which checksums and feature statistics pass: a store audited against another target of
the same architecture (other random weights), a peer import whose layer ids are one off, a feature zeroed in one
sample. The stores are real: extracted from the tiny target by ``run_extract``, exported and imported through the
CLI, or rewritten from a real store's samples with ``StoreWriter``; what each should give follows from how it was
made, not from the audit code.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil

import numpy as np
import pytest
import torch

import hsstore
from hsstore import StoreWriter
from hsstore.app.cli import main
from hsstore.extract.job import ExtractSettings, run_extract
from hsstore.extract.tiny import demo_conversations_path, tiny_target_dir
from hsstore.app.schema import build

pytestmark = pytest.mark.slow  # the target's eager forward over every store it audits

LAYERS = [1, 4, 7]  # 7: the tiny target's last layer (speculators' export needs it)
N = 6


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    path = tmp_path_factory.mktemp("audit-in") / "in.jsonl"
    path.write_text("\n".join(demo_conversations_path().read_text().splitlines()[:N]) + "\n")
    return path


def extracted(tmp_path_factory, rows, **kw) -> str:
    out = str(tmp_path_factory.mktemp("audit-store") / "store")
    run_extract(build(ExtractSettings, model=str(tiny_target_dir()), input=[str(rows)], out=out, device="cpu",
                      dtype="bfloat16", layers=LAYERS, progress=False, **kw))
    return out


@pytest.fixture(scope="module")
def store_url(tmp_path_factory, rows):
    return extracted(tmp_path_factory, rows)


def audit_cli(capsys, url, model, *extra) -> tuple[int, str, str]:
    rc = main(["audit", url, "--model", str(model), "--device", "cpu", "-q", *extra])
    out = capsys.readouterr()
    return rc, out.out, out.err


def line_with(text: str, *words: str) -> str:
    """The one line of ``text`` holding every word (the test's failure shows the whole text otherwise)."""
    found = [ln for ln in text.splitlines() if all(w in ln for w in words)]
    assert len(found) == 1, text
    return found[0]


def within(text: str, layer: int) -> str:
    """The 'within the bound' column of a feature's row in the human report."""
    found = [ln.split()[-1] for ln in text.splitlines() if ln.startswith(f"layer {layer} ")]
    assert len(found) == 1, text
    return found[0]


def test_own_target_passes_another_target_of_the_same_architecture_fails(store_url, capsys):
    rc, out, err = audit_cli(capsys, store_url, tiny_target_dir())
    assert rc == 0, out + err
    assert out.splitlines()[-1].startswith("audit: OK")
    for layer in LAYERS:  # one line per feature, every audited sample within the bound
        assert within(out, layer) == f"{N}/{N}"  # the default of 8 is more than the store's 6
    other = tiny_target_dir(seed=1)  # same config and tokenizer, other random weights
    rc, out, err = audit_cli(capsys, store_url, other)
    assert rc == 1, out + err  # the manifest's record of the weights says it before any forward
    assert "weights_fingerprint" in line_with(out, "FAIL weights: a different target:", str(other))
    assert out.splitlines()[-1] == "audit: FAILED, the model's weights are not those the store was extracted from"
    assert err.startswith("hsstore audit: weights: a different target") and len(err.splitlines()) == 1


def unrecorded(src, url: str, weights_hash: bool = False) -> str:
    """A copy of store ``src`` whose manifest records nothing of the weights (an import, a store written before the
    records), or only the embedding's ``weights_hash`` (a store written before ``weights_fingerprint``)."""
    m = src.manifest
    target = m.target if weights_hash else dataclasses.replace(m.target, weights_hash=None)
    return rewritten(src, url, lambda hs: hs, manifest=dataclasses.replace(m, target=target, extra={}))


def test_without_a_record_of_the_weights_the_bound_finds_another_target(store_url, tmp_path, capsys):
    url = unrecorded(hsstore.open(store_url), str(tmp_path / "bare"))
    rc, out, err = audit_cli(capsys, url, tiny_target_dir(seed=1))
    assert rc == 1, out + err
    for layer in LAYERS:
        assert "a different target" in line_with(out, "FAIL", f"layer {layer}:")
    assert out.splitlines()[-1] == f"audit: FAILED, {len(LAYERS)} of {len(LAYERS)} features"
    assert err.startswith("hsstore audit: layer 1: a different target") and len(err.splitlines()) == 1


def test_a_store_that_records_only_the_embeddings_hash_is_held_to_it(store_url, tmp_path, capsys):
    url = unrecorded(hsstore.open(store_url), str(tmp_path / "older"), weights_hash=True)
    rc, out, err = audit_cli(capsys, url, tiny_target_dir(seed=1))
    assert rc == 1, out + err
    assert "weights_hash" in line_with(out, "FAIL weights: a different target:", "embedding is not the one")
    rc, out, err = audit_cli(capsys, url, tiny_target_dir())
    assert rc == 0, out + err


def test_a_target_with_one_layer_scaled_by_1_05_is_a_different_target(store_url, tmp_path, capsys):
    """Layer 3's MLP down projection scaled by 1.05: the features it changes stay inside the bound, which is made
    for rounding (their relative error is many times a genuine re-run's, and under it), so only the fingerprint of
    the weights, which samples every tensor, sees it."""
    from safetensors.torch import load_file, save_file

    scaled = tmp_path / "scaled"
    shutil.copytree(tiny_target_dir(), scaled)
    weights = load_file(str(scaled / "model.safetensors"))
    weights["model.layers.3.mlp.down_proj.weight"] *= 1.05
    save_file(weights, str(scaled / "model.safetensors"), metadata={"format": "pt"})
    rc, out, err = audit_cli(capsys, store_url, scaled)
    assert rc == 1, out + err
    assert "weights_fingerprint" in line_with(out, "FAIL weights: a different target:", str(scaled))
    rc, out, err = audit_cli(capsys, unrecorded(hsstore.open(store_url), str(tmp_path / "bare")), scaled)
    assert rc == 0 and out.splitlines()[-1].startswith("audit: OK"), out + err  # what the values alone cannot see


def test_import_with_layer_ids_one_off_names_the_shift(store_url, tmp_path, capsys):
    # the store's taps (hsstore ids 1, 4, 7) go out in speculators' layout and come back read as vLLM ids
    # (--peer-layers: id i is the output of layer i-1): the store then claims layers 0, 3, 6 and holds 1, 4, 7
    assert main(["export", "speculators", store_url, str(tmp_path / "spec"), "-q"]) == 0
    imported = str(tmp_path / "imported")
    assert main(["import", "speculators", str(tmp_path / "spec"), "--out", imported, "--model",
                 str(tiny_target_dir()), "--peer-layers", ",".join(map(str, LAYERS)), "-q"]) == 0
    assert hsstore.open(imported).manifest.layers == (0, 3, 6)
    capsys.readouterr()
    rc, out, err = audit_cli(capsys, imported, tiny_target_dir(), "--json")
    assert rc == 1, out + err
    report = json.loads(out)
    assert not report["ok"]
    for claimed, held in ((0, 1), (3, 4), (6, 7)):
        v = report["features"][f"layer {claimed}"]
        assert v["diagnosis"] == "a different layer" and v["diagnosed_samples"] == v["samples"] == N
        assert f"stored layer {claimed} matches the target's layer {held} " in v["detail"]
        assert "off-by-one" in v["detail"]
    rc, out, err = audit_cli(capsys, imported, tiny_target_dir())
    assert rc == 1
    assert "matches the target's layer 1 " in line_with(out, "FAIL", "layer 0:")


def test_a_feature_zeroed_in_one_sample_is_named_zeros(store_url, tmp_path, capsys):
    src = hsstore.open(store_url)
    zeroed = src.sample_ids()[2]
    url = str(tmp_path / "zeroed")
    with StoreWriter(url, src.manifest, check_finite=True) as w:
        for i in range(len(src)):
            item = src.read(i)
            hs = item["hidden_states"].clone()
            if item["sample_id"] == zeroed:
                hs[:, 1] = 0  # layer 4, what vLLM gave on hybrid targets
            w.add(item["sample_id"], item["input_ids"], item["loss_mask"], hs)
    rc, out, err = audit_cli(capsys, url, tiny_target_dir(), "--samples", str(N))  # every sample: the zeroed one too
    assert rc == 1, out + err
    fail = line_with(out, "FAIL layer")
    assert fail.startswith(f"FAIL layer 4: zeros: stored layer 4 is all zeros (1 of {N} samples, first {zeroed!r}")
    assert (within(out, 1), within(out, 4), within(out, 7)) == (f"{N}/{N}", f"{N - 1}/{N}", f"{N}/{N}")
    rc, out, err = audit_cli(capsys, url, tiny_target_dir(), "--samples", str(N), "--json")
    bad = [r for r in json.loads(out)["results"] if not r["ok"]]
    assert [(r["sample_id"], r["feature"], r["diagnosis"]) for r in bad] == [(zeroed, "layer 4", "zeros")]


def rewritten(src, url, change=lambda hs: hs, layers=None, manifest=None) -> str:
    """A copy of store ``src`` written with ``StoreWriter`` (under ``manifest``, default ``src``'s), each sample's
    hidden states passed through ``change(hidden_states [T, taps, H]) -> the stored ones``: genuine chunks and
    checksums, planted values; its manifest claims the taps ``layers`` (default: those it holds)."""
    manifest = manifest or src.manifest
    if layers is not None:
        manifest = dataclasses.replace(manifest, layers=tuple(layers))
    with StoreWriter(url, manifest, check_finite=True) as w:
        for i in range(len(src)):
            item = src.read(i)
            w.add(item["sample_id"], item["input_ids"], item["loss_mask"], change(item["hidden_states"].clone()))
    return url


# the documented bfloat16 bound (docs/ARCHITECTURE.md, "Bounds that follow the rounding"; docs/PERFORMANCE.md):
# 1 - cosine <= 1e-4 + 6e-5 x depth, relative error <= 1.25 sqrt(2 (1 - cosine bound)). Written out here: values
# planted by it test the code against the documented bound, so code that drifts from it fails
FLOOR, PER_LAYER, REL_MARGIN = 1e-4, 6e-5, 1.25


def documented(depth: int) -> tuple[float, float]:
    """(1 - cosine, relative error) the documented bfloat16 bound allows after ``depth`` layers."""
    gap = FLOOR + PER_LAYER * depth
    return gap, REL_MARGIN * (2 * gap) ** 0.5


def scaled(times: float, depth: int):
    """Features ``[T, H]`` scaled by ``1 + times x`` the relative error the documented bound allows at ``depth``
    (their cosine stays 1)."""
    return lambda x: x * (1 + times * documented(depth)[1])


def turned(times: float, depth: int, seed: int = 0):
    """Features ``[T, H]`` with noise orthogonal to the whole feature added, so that ``1 - cosine`` is ``times x``
    what the documented bound allows at ``depth`` (their relative error stays below its own bound)."""
    def fn(x: torch.Tensor) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        noise = torch.randn(x.shape, generator=g, dtype=torch.float64)
        noise -= (noise * x).sum() / (x * x).sum() * x
        c = 1 - times * documented(depth)[0]
        return x + noise * ((1 / c ** 2 - 1) ** 0.5 * x.norm() / noise.norm())
    return fn


def planted(layers, fn_by_tap: dict):
    """A ``change`` for ``rewritten``: ``fn_by_tap[layer]`` applied to that tap's features (of the store's taps
    ``layers``), in float64, stored back in the store's dtype."""
    def change(hs: torch.Tensor) -> torch.Tensor:
        for j, layer in enumerate(layers):
            if layer in fn_by_tap:
                hs[:, j] = fn_by_tap[layer](hs[:, j].double()).to(hs.dtype)
        return hs
    return change


@pytest.mark.parametrize("plant", ["scaled", "turned"])
def test_stored_features_just_past_the_bound_fail_and_just_inside_pass(store_url, tmp_path, capsys, plant):
    """At 8 layers: tap 4 planted 0.9 times what the documented bound allows at its depth, tap 7 1.1 times, by
    scaling (the cosine stays 1: only the relative error's margin sees it) or by turning (``1 - cosine``: the
    per-layer drift). The stored features change, never the target: no weights check answers first."""
    how = {"scaled": scaled, "turned": turned}[plant]
    src = hsstore.open(store_url)
    url = rewritten(src, str(tmp_path / plant), planted(LAYERS, {4: how(0.9, 5), 7: how(1.1, 8)}))
    rc, out, err = audit_cli(capsys, url, tiny_target_dir(), "--json")
    f = json.loads(out)["features"]
    assert rc == 1 and f["layer 1"]["ok"] and f["layer 4"]["ok"] and not f["layer 7"]["ok"], f
    assert f["layer 7"]["samples_ok"] == 0 and f["layer 7"]["diagnosed_samples"] == N
    if plant == "scaled":
        assert 0.85 < f["layer 4"]["max_rel_err"] / documented(5)[1] < 0.95
        assert 1.05 < f["layer 7"]["max_rel_err"] / documented(8)[1] < 1.15
        assert f["layer 7"]["diagnosis"] == "scaled values"
    else:
        assert 0.85 < (1 - f["layer 4"]["min_cosine"]) / documented(5)[0] < 0.95
        assert 1.05 < (1 - f["layer 7"]["min_cosine"]) / documented(8)[0] < 1.15
        assert f["layer 7"]["max_rel_err"] <= documented(8)[1]  # the cosine alone fails it


def test_features_shifted_by_one_token_are_named_shifted(store_url, tmp_path, capsys):
    # position t holds what the target computed at t - 1 (an off-by-one between ids and features, as a capture
    # that drops the first position would give): the first row repeats
    src = hsstore.open(store_url)
    url = rewritten(src, str(tmp_path / "shifted"), lambda hs: torch.cat([hs[:1], hs[:-1]]))
    rc, out, err = audit_cli(capsys, url, tiny_target_dir(), "--json")
    assert rc == 1, out + err
    for layer in LAYERS:
        v = json.loads(out)["features"][f"layer {layer}"]
        assert v["diagnosis"] == "shifted tokens" and v["diagnosed_samples"] == v["samples"] == N, v
        assert "t-1 (one token late)" in v["detail"]


def test_a_feature_scaled_by_2_fails_on_its_relative_error_alone(store_url, tmp_path, capsys):
    # cosine stays 1 (the direction is the target's): only the relative error (1.0, the bound's ~0.03) sees it
    src = hsstore.open(store_url)

    def double(hs):
        hs[:, 2] = hs[:, 2] * 2  # layer 7
        return hs

    url = rewritten(src, str(tmp_path / "scaled"), double)
    rc, out, err = audit_cli(capsys, url, tiny_target_dir(), "--json")
    assert rc == 1, out + err
    report = json.loads(out)
    v = report["features"]["layer 7"]
    assert v["diagnosis"] == "scaled values" and v["diagnosed_samples"] == N, v
    assert v["min_cosine"] > 0.9999 and 0.99 < v["max_rel_err"] < 1.01 and "norm 2.000x" in v["detail"]
    assert report["features"]["layer 1"]["ok"] and report["features"]["layer 4"]["ok"]
    assert err.startswith("hsstore audit: layer 7: scaled values") and len(err.splitlines()) == 1


def test_the_bound_grows_with_depth_as_documented(store_url, capsys):
    # docs/ARCHITECTURE.md: 1 - cosine <= floor + per_layer x depth, depth l + 1 for tap l, relative error <=
    # 1.25 sqrt(2 (1 - cosine bound)); bfloat16 floor 1e-4, per layer 6e-5
    rc, out, err = audit_cli(capsys, store_url, tiny_target_dir(), "--json")
    assert rc == 0, out + err
    report = json.loads(out)
    assert report["bound"]["floor"] == 1e-4 and report["bound"]["per_layer"] == pytest.approx(6e-5)
    for layer in LAYERS:
        gap = 1e-4 + 6e-5 * (layer + 1)
        b = report["features"][f"layer {layer}"]["bound"]
        assert b["cosine"] == pytest.approx(1 - gap) and b["rel_err"] == pytest.approx(1.25 * (2 * gap) ** 0.5)


def test_an_fp8_store_holds_its_bound(tmp_path_factory, rows, capsys):
    url = extracted(tmp_path_factory, rows, encoding="fp8")
    assert hsstore.open(url).manifest.encoding == "fp8"
    rc, out, err = audit_cli(capsys, url, tiny_target_dir(), "--json")
    assert rc == 0, out + err
    report = json.loads(out)
    assert report["encoding"] == "fp8" and "fp8" in report["bound"]["why"]
    for v in report["features"].values():
        assert v["ok"] and v["samples_ok"] == N
        # e4m3 keeps 3 mantissa bits: the stored values are not the recomputed ones bit for bit, yet far closer than
        # a neighbour layer (cosine <= 0.99 on this target)
        assert 0.995 < v["min_cosine"] < 1 - 1e-6 and 1e-4 < v["max_rel_err"] < 0.1


def digest(ids) -> bytes:
    """The documented rule: BLAKE2b-64 of the ids as little-endian int32."""
    return hashlib.blake2b(np.asarray(ids, dtype="<i4").tobytes(), digest_size=8).digest()


def audited_ids(capsys, url, n) -> list[str]:
    capsys.readouterr()  # what the commands before printed
    rc, out, err = audit_cli(capsys, url, tiny_target_dir(), "--samples", str(n), "--json")
    assert rc == 0, out + err
    return [s["sample_id"] for s in json.loads(out)["samples"]]


def test_the_samples_are_chosen_by_content_in_every_copy(store_url, tmp_path, capsys):
    src = hsstore.open(store_url)
    by_digest = sorted((digest(src.read(i)["input_ids"]), src.sample_ids()[i]) for i in range(len(src)))
    want = {sid for _, sid in by_digest[:3]}
    assert set(audited_ids(capsys, store_url, 3)) == want
    wds = str(tmp_path / "wds")  # another layout, other shards: the same samples
    assert main(["convert", store_url, wds, "--layout", "wds", "-q"]) == 0
    assert set(audited_ids(capsys, wds, 3)) == want
    # `hsstore subset` without the shortest sample: the three lowest of those left
    lengths = [len(src.read(i)["input_ids"]) for i in range(len(src))]
    sub = str(tmp_path / "sub")
    assert main(["subset", store_url, sub, "--min-length", str(min(lengths) + 1), "-q"]) == 0
    left = [(d, sid) for d, sid in by_digest if lengths[src.sample_ids().index(sid)] > min(lengths)]
    assert len(left) == len(src) - 1
    assert set(audited_ids(capsys, sub, 3)) == {sid for _, sid in left[:3]}
    # a copy written in reverse order: the same samples (ties aside, store order plays no part)
    rev = str(tmp_path / "reversed")
    with StoreWriter(rev, src.manifest) as w:
        for i in reversed(range(len(src))):
            item = src.read(i)
            w.add(item["sample_id"], item["input_ids"], item["loss_mask"], item["hidden_states"])
    assert set(audited_ids(capsys, rev, 3)) == want


def test_bad_input_is_one_line_exit_2(store_url, tmp_path, capsys):
    for args, words in (([store_url, "--model", str(tiny_target_dir()), "--samples", "0"], "--samples"),
                        ([store_url, "--model", str(tmp_path / "nope")], "nope"),
                        ([str(tmp_path / "no-store"), "--model", str(tiny_target_dir())], "no-store")):
        assert main(["audit", *args, "-q"]) == 2
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and err.startswith("hsstore audit: error:") and words in err, err
