"""A compiled extraction checks its first batch against the eager forward (extract/compile_check.py): on the real
tiny Qwen3.5 target compiled on the CPU it passes and is recorded in the manifest per rank; a compiled forward made
to disagree at one layer stops the run before anything is written, naming the tap, and the store stays resumable."""

import dataclasses
import json

import pytest
import torch

import hsstore
from hsstore.extract import job
from hsstore.app.target import decoder_layers
from hsstore.extract.compare import COMPILE_DRIFT
from hsstore.extract.compile_check import CompileMismatch, check_first_batch, eager_modules
from hsstore.extract.forward import packed_features, token_budget_batches
from hsstore.extract.job import ExtractSettings, run_extract
from hsstore.extract.speed import compile_forward
from hsstore.app.target import load_target
from hsstore.extract.tokenize import load_samples
from hsstore.ops.verify import verify
from hsstore.app.schema import build
from conftest import make_manifest, make_samples, write_samples
from train_helpers import small_input  # noqa: F401  (fixture)

pytestmark = pytest.mark.slow  # compiles the tiny target's forward


def manifest_extra(url) -> dict:
    with open(f"{url}/manifest.json") as f:
        return json.load(f)["extra"]


def commit_names(url) -> list[str]:
    return sorted(p.name for p in (url / "commits").iterdir()) if (url / "commits").exists() else []


def test_eager_modules_is_the_eager_forward_and_the_check_passes(tiny_dir, tok, small_input):  # noqa: F811
    model = load_target(str(tiny_dir), torch.bfloat16, torch.device("cpu"))
    batch = token_budget_batches(list(load_samples(small_input, tok)), 4096)[0]
    layers = [1, 3, 5]
    before = packed_features(model, layers, batch, 0, torch.device("cpu"))
    compile_forward(model, mixers=True)  # what `extract --compile` runs
    with eager_modules(model):
        assert torch.equal(packed_features(model, layers, batch, 0, torch.device("cpu")), before)
    assert all(m._compiled_call_impl is not None for m in decoder_layers(model)[0].modules()
               if type(m).__name__.endswith("MLP"))  # put back after the block
    check = check_first_batch(model, layers, batch, 0, torch.device("cpu"))
    assert check.passed and check.tokens == before.shape[0] and set(check.per_tap) == {"1", "3", "5"}
    assert check.min_cos < 1 and check.max_rel > 0  # compiled: close, not bit-equal
    for tap, t in check.per_tap.items():  # each tap within the bound at its depth: 1 - cos <= floor + per_layer (l + 1)
        gap = COMPILE_DRIFT.floor + COMPILE_DRIFT.per_layer * (int(tap) + 1)
        assert t["bound_cos"] == pytest.approx(1 - gap) and t["min_cos"] >= 1 - gap
        assert t["bound_rel"] == pytest.approx(1.25 * (2 * gap) ** 0.5) and t["max_rel"] <= t["bound_rel"]
    assert check.per_tap["1"]["bound_cos"] > check.per_tap["3"]["bound_cos"] > check.per_tap["5"]["bound_cos"]


def test_compiled_extraction_records_its_check_per_rank(tiny_dir, small_input, tmp_path):  # noqa: F811
    out = tmp_path / "s"
    cfg = dict(model=str(tiny_dir), input=[str(small_input)], out=str(out), device="cpu", progress=False,
               force=True)
    res = run_extract(build(ExtractSettings, **cfg, compile=True, rank=0, world_size=2))
    assert res.compiled and res.compile_check.passed and res.warmup_s > 0
    rec = manifest_extra(out)["compile_check"]["rank00000"]
    assert rec["compiled"] and rec["passed"] and rec["bound"]["floor"] == COMPILE_DRIFT.floor
    assert rec["bound"]["per_layer"] == COMPILE_DRIFT.per_layer and "tap + 1" in rec["bound"]["rule"]
    assert rec["tokens"] == res.compile_check.tokens > 0 and rec["min_cos"] < 1
    assert all(t["min_cos"] >= t["bound_cos"] for t in rec["per_tap"].values())
    assert set(rec["per_tap"]) == {str(l) for l in hsstore.open(str(out)).layers}
    run_extract(build(ExtractSettings, **cfg, compile=False, rank=1, world_size=2))  # an eager rank records nothing
    assert list(manifest_extra(out)["compile_check"]) == ["rank00000"]
    res = run_extract(build(ExtractSettings, **cfg, compile=True, rank=1, world_size=2))
    assert res.samples == 0 and res.compile_check is None  # nothing left to extract: nothing to check
    assert verify(hsstore.open(str(out))).ok and len(hsstore.open(str(out))) == 8
    eager = manifest_extra(_eager_store(tiny_dir, small_input, tmp_path))
    assert "compile_check" not in eager
    assert eager["weights_fingerprint"] == manifest_extra(out)["weights_fingerprint"]  # compiled or not, one model


def _eager_store(tiny_dir, small_input, tmp_path):  # noqa: F811
    out = tmp_path / "eager"
    run_extract(build(ExtractSettings, model=str(tiny_dir), input=[str(small_input)], out=str(out), device="cpu",
                      progress=False, force=True, compile=False))
    return out


def test_writers_merge_their_entries_into_the_manifest(tmp_path):
    """Each writer adds its own ``compile_check`` entry to the manifest in force, keeping the others' and the rest
    of ``extra``; a writer without one changes nothing."""
    url = tmp_path / "s"
    base = make_manifest()
    for i, tag in enumerate(("rank00000", "rank00001")):
        m = dataclasses.replace(base, extra={"note": "x", "compile_check": {tag: {"passed": True}}})
        write_samples(str(url), m, make_samples(2, seed=i, prefix=tag), writer_tag=tag)
    write_samples(str(url), base, make_samples(2, seed=2, prefix="eager"), writer_tag="rank00002")
    extra = manifest_extra(url)
    assert extra == {"note": "x", "compile_check": {"rank00000": {"passed": True}, "rank00001": {"passed": True}}}
    assert verify(hsstore.open(str(url))).ok


def test_a_compiled_forward_that_disagrees_stops_before_writing(tiny_dir, small_input, tmp_path, monkeypatch):  # noqa: F811
    """Fault injection: after compiling, the compiled call of decoder layer 2's MLP adds noise (the eager call, and
    the model, stay as they are). The first tap at or after layer 2 is named, and nothing of the run is written."""
    out = tmp_path / "s"
    half = tmp_path / "half.jsonl"
    half.write_text("".join(small_input.read_text().splitlines(keepends=True)[:4]))
    cfg = dict(model=str(tiny_dir), out=str(out), device="cpu", progress=False, force=True, layers=[1, 3, 5])
    run_extract(build(ExtractSettings, **cfg, input=[str(half)], compile=False))  # 4 samples committed earlier
    before = commit_names(out)
    real_compile = job.compile_forward

    def compile_with_fault(model, **kw):
        report = real_compile(model, **kw)
        mlp = decoder_layers(model)[2].mlp
        compiled = mlp._compiled_call_impl

        def noisy(*a, **k):
            y = compiled(*a, **k)
            g = torch.Generator().manual_seed(0)
            return y + 0.02 * a[0].float().std() * torch.randn(y.shape, generator=g).to(y.dtype)  # of its input

        mlp._compiled_call_impl = noisy
        return report

    monkeypatch.setattr(job, "compile_forward", compile_with_fault)
    with pytest.raises(CompileMismatch, match=r"beyond bf16 rounding at tap 3 on the first batch .*at this depth.*"
                                              r"[0-9.]+x what rounding allows; nothing was written.*--no-compile to "
                                              r"use the eager forward") as e:
        run_extract(build(ExtractSettings, **cfg, input=[str(small_input)], compile=True))
    assert "\n" not in str(e.value)
    assert commit_names(out) == before and len(hsstore.open(str(out))) == 4  # no shard of that batch
    assert "compile_check" not in manifest_extra(out) and verify(hsstore.open(str(out))).ok
    monkeypatch.undo()
    res = run_extract(build(ExtractSettings, **cfg, input=[str(small_input)], compile=False))  # resumes
    assert res.skipped_done == 4 and res.samples == 4 and len(hsstore.open(str(out))) == 8

    fresh = tmp_path / "fresh"  # a new store: not even its folder is made
    monkeypatch.setattr(job, "compile_forward", compile_with_fault)
    with pytest.raises(CompileMismatch, match="at tap 3"):
        run_extract(build(ExtractSettings, **{**cfg, "out": str(fresh)}, input=[str(small_input)], compile=True))
    assert not fresh.exists()


# -- the check's bounds where they bite: a compiled call planted at the last tap, its output changed ------------------
TAPS = [1, 3, 5]


def plant(layer: torch.nn.Module, change) -> None:
    """Decoder ``layer``'s compiled call is its eager forward with ``change`` applied to the layer's output (the
    capture hooks see the changed output); ``eager_modules`` sets it aside as it does a real compiled call."""
    forward = layer.forward

    def changed(*a, **k):
        out = forward(*a, **k)
        return (change(out[0]), *out[1:]) if isinstance(out, tuple) else change(out)

    def compiled(*a, **k):
        layer.forward = changed
        try:
            return layer._call_impl(*a, **k)
        finally:
            del layer.forward

    layer._compiled_call_impl = compiled


@pytest.fixture(scope="module")
def first_batch(tok, small_input):  # noqa: F811
    return token_budget_batches(list(load_samples(small_input, tok))[:2], 4096)[0]


@pytest.fixture(scope="module")
def target32(tiny_dir):
    return load_target(str(tiny_dir), torch.float32, torch.device("cpu"), progress=False)


def checked(model, batch, change):
    """``check_first_batch`` on the tiny target in float32 (the eager forward exact), its tap 5 (depth 6, the last:
    nothing after it runs) changed by ``change`` in the compiled call."""
    layer = decoder_layers(model)[5]
    plant(layer, change)
    try:
        return check_first_batch(model, TAPS, batch, 0, torch.device("cpu"))
    finally:
        layer._compiled_call_impl = None


def off_by(x: torch.Tensor, one_minus_cos: float) -> torch.Tensor:
    """``x`` ``[..., H]`` with noise orthogonal to each row added, so that each row's cosine to ``x`` is
    ``1 - one_minus_cos`` (the relative error is then ``sqrt(1 / cos^2 - 1)``, about ``sqrt(2 (1 - cos))``)."""
    g = torch.Generator().manual_seed(0)
    noise = torch.randn(x.shape, generator=g, dtype=torch.float64)
    xd = x.double()
    noise -= (noise * xd).sum(-1, keepdim=True) / (xd * xd).sum(-1, keepdim=True).clamp_min(1e-300) * xd
    c = 1.0 - one_minus_cos
    r = (1.0 / c ** 2 - 1.0) ** 0.5
    noise *= r * xd.norm(dim=-1, keepdim=True) / noise.norm(dim=-1, keepdim=True).clamp_min(1e-300)
    return (xd + noise).to(x.dtype)


def test_nan_in_the_compiled_features_fails_the_check(target32, first_batch):
    """One token of tap 5 NaN: a NaN cosine or relative error is the worst figure, never a pass."""
    def one_nan(out):
        out = out.clone()
        out[0, 3] = float("nan")
        return out

    with pytest.raises(CompileMismatch, match=r"at tap 5 on the first batch .*min per-token cosine -1\.00000"):
        checked(target32, first_batch, one_nan)


def test_compiled_features_at_twice_the_scale_fail_on_their_relative_error(target32, first_batch):
    """Tap 5 doubled: every cosine is 1, the relative error 1; only the bound's relative-error half sees it."""
    with pytest.raises(CompileMismatch, match=r"at tap 5 .*min per-token cosine 1\.00000 .*max relative error "
                                              r"1\.0000 \(bound <="):
        checked(target32, first_batch, lambda out: out * 2)


@pytest.mark.parametrize("times,passes", [(0.75, True), (1.25, False)])
def test_the_per_layer_drift_is_the_documented_one(target32, first_batch, times, passes):
    """Tap 5's compiled features off by ``times`` the documented drift at its depth (``1 - cos = floor + per_layer
    x 6`` per token): just inside passes, just past fails; a wider per-layer allowance in the code passes both."""
    gap = 1e-3 + 5.1e-4 * 6  # the documented bound (docs/PERFORMANCE.md): floor 1e-3, 5.1e-4 per layer, written out
    change = lambda out: off_by(out, times * gap)  # noqa: E731
    if passes:
        check = checked(target32, first_batch, change)
        assert 1 - check.per_tap["5"]["min_cos"] == pytest.approx(times * gap, rel=1e-3)
        assert check.per_tap["1"]["min_cos"] > 1 - 1e-6  # the taps before it are the eager forward's own
    else:
        with pytest.raises(CompileMismatch, match=r"at tap 5 .*min per-token cosine 0\.99[0-9]+ \(bound >= 0\.99594"):
            checked(target32, first_batch, change)
