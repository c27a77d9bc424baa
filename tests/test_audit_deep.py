"""`hsstore audit` at the seeds' depth: a 64-layer target (the tiny target's narrow shape, random weights, Gated
DeltaNet and full attention 3 + 1 as Qwen3.5's) on which a deep layer and the layers beside it sit inside each
other's bounds, as they do at 64 layers of hidden 5120 (docs/PERFORMANCE.md, "Bounds at the seeds' depth").

There the bound alone passes an off-by-one tap, and only the neighbour rule (closer to its own recomputed layer
than to the layers beside it) catches it, in either direction; and a stored feature scaled or turned just past the
bound at its depth fails while just inside passes. The stores are real: extracted from the target by
``run_extract``, then rewritten with ``StoreWriter`` under other tap ids or with planted values (the stored
features change, never the target, so no weights check can answer first).
"""

from __future__ import annotations

import json

import pytest

import hsstore
from hsstore.app.cli import main
from hsstore.app.schema import build
from hsstore.extract.job import ExtractSettings, run_extract
from hsstore.extract.tiny import tiny_target_dir
from test_audit import documented, planted, rewritten, scaled, turned

pytestmark = pytest.mark.slow  # a 64-layer forward per audited sample

N_LAYERS = 64
HELD = (46, 53, 60, 62)  # the layers extracted; each has a neighbour inside its bound (asserted below)
N = 3


@pytest.fixture(scope="module")
def deep_dir():
    return tiny_target_dir(num_layers=N_LAYERS)


@pytest.fixture(scope="module")
def deep_store(deep_dir, tmp_path_factory):
    """Short conversations extracted from the 64-layer target in bfloat16, layers HELD."""
    d = tmp_path_factory.mktemp("deep")
    rows = [{"id": f"r{i}", "messages": [
        {"role": "user", "content": f"Please add {i} and {i + 3}, then say the sum."},
        {"role": "assistant", "content": f"The sum of {i} and {i + 3} is {2 * i + 3}.",
         "reasoning_content": f"{i} plus {i + 3} makes {2 * i + 3}."}]} for i in range(N)]
    (d / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = str(d / "store")
    run_extract(build(ExtractSettings, model=str(deep_dir), input=[str(d / "in.jsonl")], out=out, device="cpu",
                      dtype="bfloat16", layers=list(HELD), progress=False, force=True))
    return out


def audited(capsys, url: str, model) -> tuple[int, dict]:
    capsys.readouterr()
    rc = main(["audit", url, "--model", str(model), "--device", "cpu", "-q", "--json"])
    out = capsys.readouterr().out
    return rc, json.loads(out)


def within_bound(v: dict) -> bool:
    """Whether a feature's worst figures hold the bound at its depth (the audit's first rule alone)."""
    return v["min_cosine"] >= v["bound"]["cosine"] and v["max_rel_err"] <= v["bound"]["rel_err"]


def test_an_off_by_one_tap_inside_the_bound_is_caught_by_the_neighbour_rule(deep_store, deep_dir, tmp_path, capsys):
    """The store claims taps 45, 54, 60, 61 and holds layers 46, 53, 60, 62: two taps one higher (vLLM's and
    speculators' count), one lower, one right. Each shifted one holds the bound of the layer it claims (the
    bound alone would pass it) and is closer to the layer beside it: 'a different layer', named."""
    url = rewritten(hsstore.open(deep_store), str(tmp_path / "shifted"), layers=(45, 54, 60, 61))
    rc, report = audited(capsys, url, deep_dir)
    assert rc == 1 and not report["ok"]
    f = report["features"]
    assert f["layer 60"]["ok"] and f["layer 60"]["samples_ok"] == N
    for claimed, held in ((45, 46), (54, 53), (61, 62)):
        v = f[f"layer {claimed}"]
        assert within_bound(v), v  # where the guard bites: the bound at this depth holds the neighbour
        assert v["diagnosis"] == "a different layer" and v["diagnosed_samples"] == v["samples"] == N, v
        assert f"stored layer {claimed} matches the target's layer {held} " in v["detail"]
        assert "off-by-one" in v["detail"]


def test_the_bounds_at_64_layers_fail_just_past_and_pass_just_inside(deep_store, deep_dir, tmp_path, capsys):
    """Scaled by 0.9 and 1.1 times the relative error allowed at the tap's depth (the cosine stays 1), and turned
    by 0.9 and 1.1 times the allowed ``1 - cosine``: the audit passes the ones inside and fails the ones past."""
    change = planted(HELD, {53: scaled(0.9, 54), 62: scaled(1.1, 63), 46: turned(0.9, 47), 60: turned(1.1, 61)})
    url = rewritten(hsstore.open(deep_store), str(tmp_path / "planted"), change)
    rc, report = audited(capsys, url, deep_dir)
    f = report["features"]
    assert rc == 1 and f["layer 53"]["ok"] and f["layer 46"]["ok"], f
    assert 0.85 < f["layer 53"]["max_rel_err"] / documented(54)[1] < 0.95
    v = f["layer 62"]
    assert not v["ok"] and v["diagnosis"] == "scaled values" and v["diagnosed_samples"] == N, v
    assert 1.05 < v["max_rel_err"] / documented(63)[1] < 1.15
    v = f["layer 60"]
    assert not v["ok"] and v["samples_ok"] == 0 and v["max_rel_err"] <= documented(61)[1], v
    assert 1.05 < (1 - v["min_cosine"]) / documented(61)[0] < 1.15
