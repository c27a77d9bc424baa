"""The gate runs once: `check --report` is reused by `extract --gate-report` on every rank, and refused when the
input, tokenizer or settings differ from what was checked."""

import json
import os

import pytest

import hsstore
from hsstore.app.cli import main as hsstore_cli
from hsstore.extract.gate import GateThresholds
from hsstore.extract.gate_report import GateReportMismatch
from hsstore.extract.chat_tokenizer import ChatTokenizer
from hsstore.extract.job import ExtractSettings, run_extract
from hsstore.app.schema import build

LENIENT = {"max_stub_share": 1.0, "max_duplicate_share": 1.0, "max_top_share": 1.0, "max_empty_thinking_share": 1.0}


def row(i, answer=None, reasoning="Think about it step by step, then answer."):
    return {"id": f"r{i}", "messages": [
        {"role": "user", "content": f"Question number {i}?"},
        {"role": "assistant", "content": answer or f"The answer is {i} because it is.", "reasoning_content": reasoning}]}


@pytest.fixture
def data(tmp_path):
    """Ten conversations: one a stub, one a token-for-token copy of another under a new id."""
    rows = [row(i) for i in range(8)] + [row(8, "OK.", "")]
    copy = row(2)
    copy["id"] = "r2-copy"
    rows.append(copy)
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def flag_args(thresholds: dict) -> list[str]:
    return [a for k, v in thresholds.items() for a in ("--" + k.replace("_", "-"), str(v))]


def counted_tokenize(monkeypatch) -> list:
    seen = []
    real = ChatTokenizer.tokenize
    monkeypatch.setattr(ChatTokenizer, "tokenize", lambda self, rec, **k: seen.append(rec.sample_id) or
                        real(self, rec, **k))
    return seen


def test_ranks_reuse_the_report_and_tokenize_only_their_rows(tiny_dir, data, tmp_path, capsys, monkeypatch):
    report = tmp_path / "gate.json"
    assert hsstore_cli(["check", "--model", str(tiny_dir), "--input", str(data), "--report", str(report)]
                       + flag_args(LENIENT)) == 0
    doc = json.loads(report.read_text())
    assert doc["report"]["ok"] and doc["duplicate_ids"] == ["r2-copy"]
    assert doc["identity"]["inputs"][0]["files"][0]["bytes"] == data.stat().st_size

    seen = counted_tokenize(monkeypatch)
    out = str(tmp_path / "store")
    base = dict(model=str(tiny_dir), input=[str(data)], device="cpu", progress=False, world_size=2,
                thresholds=GateThresholds(**LENIENT))
    results = [run_extract(build(ExtractSettings, out=out, rank=r, gate_report=str(report), **base)) for r in (0, 1)]
    assert seen == ["r0", "r2", "r4", "r6", "r8"] + ["r1", "r3", "r5", "r7", "r2-copy"]  # row i -> rank i % 2
    assert all(r.gate is None and r.rows == 5 for r in results)  # no rank re-ran the gate

    # the store is what one process without a report writes, gate flags (stub_answer, duplicate) included
    seen.clear()
    ref = str(tmp_path / "ref")
    run_extract(build(ExtractSettings, out=ref, **{**base, "world_size": 1}))
    assert len(seen) == 10
    flags = {}
    for url in (out, ref):
        store = hsstore.open(url)
        flags[url] = {store.ref(i).sample_id: store.commits[[c.shard for c in store.commits].index(
            store.ref(i).shard)].samples["flags"][store.ref(i).local] for i in range(len(store))}
    assert flags[out] == flags[ref]
    assert "stub_answer" in flags[out]["r8"] and "duplicate" in flags[out]["r2-copy"]
    assert "duplicate" not in flags[out]["r2"]

    # resume by id works across ranks and with the report
    again = run_extract(build(ExtractSettings, out=out, rank=1, gate_report=str(report), **base))
    assert again.samples == 0 and again.skipped_done == results[1].samples


def test_without_a_report_every_rank_gates_the_whole_input(tiny_dir, data, tmp_path, monkeypatch):
    seen = counted_tokenize(monkeypatch)
    r = run_extract(build(ExtractSettings, model=str(tiny_dir), input=[str(data)], out=str(tmp_path / "s"),
                          device="cpu", progress=False, rank=1, world_size=2, thresholds=GateThresholds(**LENIENT)))
    assert r.gate is not None and r.gate.n_samples == 10  # the whole input was gated
    assert r.rows == 5 and r.samples == 5
    assert len(seen) == 15  # the gate's pass over all rows, then this rank's rows


def test_a_failing_report_refuses_before_the_model_loads(tiny_dir, data, tmp_path, capsys, monkeypatch):
    import hsstore.extract.job as job

    report = tmp_path / "gate.json"
    assert hsstore_cli(["check", "--model", str(tiny_dir), "--input", str(data), "--report", str(report)]) == 1
    assert not json.loads(report.read_text())["report"]["ok"]
    capsys.readouterr()
    seen = counted_tokenize(monkeypatch)
    monkeypatch.setattr(job, "load_target", lambda *a, **k: pytest.fail("model loaded despite the gate"))
    out = tmp_path / "store"
    rc = hsstore_cli(["extract", "--model", str(tiny_dir), "--input", str(data), "--out", str(out),
                      "--gate-report", str(report), "--device", "cpu", "--no-progress"])
    captured = capsys.readouterr()
    assert rc == 1 and "refused" in captured.err and "from the gate report" in captured.out
    assert not out.exists() and seen == []  # refused before tokenizing anything


def mismatch(tiny_dir, data, report, tmp_path, capsys, *extra) -> str:
    out = tmp_path / "store"
    rc = hsstore_cli(["extract", "--model", str(tiny_dir), "--input", str(data), "--out", str(out), "--gate-report",
                      str(report), "--device", "cpu", "--no-progress", *extra])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(err) == 1 and not out.exists(), err
    return err[0]


def test_a_report_of_other_input_or_settings_is_refused_naming_the_difference(tiny_dir, data, tmp_path, capsys):
    report = tmp_path / "gate.json"
    args = ["check", "--model", str(tiny_dir), "--input", str(data), "--report", str(report), "--max-length", "4096"]
    assert hsstore_cli(args + flag_args(LENIENT)) == 0
    capsys.readouterr()
    same = ["--max-length", "4096"] + flag_args(LENIENT)

    line = mismatch(tiny_dir, data, report, tmp_path, capsys, *flag_args(LENIENT))
    assert "does not match this run: --max-length differs (report 4096, here null)" in line
    line = mismatch(tiny_dir, data, report, tmp_path, capsys, "--max-length", "4096")
    assert "--max-duplicate-share differs (report 1.0, here 0.1)" in line
    line = mismatch(tiny_dir, data, report, tmp_path, capsys, *same, "--chat-template-kwargs",
                    '{"enable_thinking": false}')
    assert "--chat-template-kwargs differs" in line

    other = tmp_path / "other"  # same vocabulary, another chat template
    other.mkdir()
    for f in tiny_dir.iterdir():
        if f.is_file():
            (other / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((other / "tokenizer_config.json").read_text())
    cfg["chat_template"] = cfg.get("chat_template", "") + "{# edited #}"
    (other / "tokenizer_config.json").write_text(json.dumps(cfg))
    if (other / "chat_template.jinja").exists():
        (other / "chat_template.jinja").write_text((other / "chat_template.jinja").read_text() + "{# edited #}")
    line = mismatch(other, data, report, tmp_path, capsys, *same)
    assert "tokenizer chat_template_hash differs" in line

    # the same bytes with a new mtime (copied elsewhere): hashed and accepted
    st = data.stat()
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    rc = hsstore_cli(["extract", "--model", str(tiny_dir), "--input", str(data), "--out", str(tmp_path / "ok"),
                      "--gate-report", str(report), "--device", "cpu", "--no-progress", *same])
    assert rc == 0
    capsys.readouterr()

    # one byte changed, size kept: the content hash tells
    text = data.read_text()
    data.write_text(text.replace("Question number 5?", "Question number 6?"))
    line = mismatch(tiny_dir, data, report, tmp_path, capsys, *same)
    assert f"input file {data} changed (content hash differs)" in line
    data.write_text(text + json.dumps(row(99)) + "\n")
    line = mismatch(tiny_dir, data, report, tmp_path, capsys, *same)
    assert f"input file {data} changed (size: report {len(text):,} bytes" in line

    with pytest.raises(GateReportMismatch, match="number of --input paths differs"):
        run_extract(build(ExtractSettings, model=str(tiny_dir), input=[str(data), str(data)], out=str(tmp_path / "x"),
                          gate_report=str(report), max_length=4096, thresholds=GateThresholds(**LENIENT)))


def test_repeated_ids_fail_the_gate(tiny_dir, tmp_path, capsys):
    path = tmp_path / "in.jsonl"
    rows = [row(i) for i in range(6)] + [row(3, "Another answer to the third question.")]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert hsstore_cli(["check", "--model", str(tiny_dir), "--input", str(path), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["repeated_ids"] == {"count": 1, "ids": ["r3"]}
    assert any("occur more than once, e.g. 'r3'" in f for f in report["failures"])
    with pytest.raises(ValueError, match="sample id 'r3' occurs more than once"):
        run_extract(build(ExtractSettings, model=str(tiny_dir), input=[str(path)], out=str(tmp_path / "s"),
                          device="cpu", progress=False, force=True))

