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
