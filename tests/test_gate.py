"""Quality gate: refuses the brief's stub-dominated set, passes the demo set, readable report, CLI."""

import argparse
import json
import subprocess
import sys

import numpy as np
import pytest
from transformers import AutoTokenizer

from hsstore.extract import cli
from hsstore.app.cli import main as hsstore_main
from hsstore.extract.gate import GateThresholds, check
from hsstore.extract.show import format_sample
from hsstore.extract.tiny import demo_conversations_path, tiny_target_dir
from hsstore.extract.sample import TokenizedSample
from hsstore.extract.tokenize import TokenizeStats, load_samples


def demo_report(tok, thresholds=None):
    stats = TokenizeStats()
    return check(load_samples(demo_conversations_path(), tok, stats=stats), thresholds, stats=stats)


# ---------------------------------------------------------------------------------------------- verdicts


def test_brief_like_stub_set_is_refused(tok, stub_file):
    report = check(load_samples(stub_file, tok))
    assert not report.ok and report.dominant
    stub_sum = report.top_loss_sum["value"]
    assert stub_sum <= 32
    assert report.top_loss_sum["share"] == pytest.approx(0.87)
    assert report.stub_share == pytest.approx(0.87)
    assert report.share("empty_thinking") == pytest.approx(0.87)
    assert report.loss_sum_percentiles["p50"] == stub_sum
    assert any("exactly" in f and "dominated" in f for f in report.failures)

    text = report.format_text(tok, n_examples=2)
    assert "hsstore quality gate: FAIL" in text
    assert f"87.0% OF SAMPLES HAVE A LOSS-MASK SUM OF EXACTLY {stub_sum} TOKENS" in text
    assert "<== DOMINATES" in text
    assert "⟦<think>\n\n</think>\n\nOK.<|im_end|>⟧" in text  # a decoded stub, mask marked
    assert text.count("\n--- r") == 2

    data = json.loads(report.to_json())
    assert data["ok"] is False
    assert data["top_loss_sum"] == {"value": stub_sum, "count": 87, "share": 0.87}
    assert data["stub_share"] == pytest.approx(0.87)
    assert sum(b["count"] for b in data["loss_sum_histogram"]) == 100
    assert len(data["flagged_ids"]["stub_answer"]) == 20


def test_dominance_alone_refuses_pretokenized_shards():
    """No tokenizer (no stub detection), just the brief's numbers: 87% of loss sums are exactly 6."""
    rng = np.random.default_rng(0)
    samples = []
    for i in range(1000):
        n_loss = 6 if i % 100 < 87 else int(rng.integers(200, 2000))
        n_prompt = int(rng.integers(50, 600))
        ids = rng.integers(0, 1000, n_prompt + n_loss).astype(np.int32)
        mask = np.r_[np.zeros(n_prompt, np.uint8), np.ones(n_loss, np.uint8)]
        samples.append(TokenizedSample(f"s{i}", ids, mask, "shards"))
    report = check(samples)
    assert not report.ok and report.dominant
    assert report.top_loss_sum == {"value": 6, "count": 870, "share": 0.87}
    assert report.stub_share == 0.0  # unknown without a tokenizer; dominance alone is enough to refuse
    assert report.loss_sum_percentiles["p50"] == 6 and report.loss_sum_mean > 6 * 10


def test_bundled_demo_set_passes_but_reports_its_stubs(tok):
    report = demo_report(tok)
    assert report.ok, report.failures
    assert report.n_samples == 31 and report.input_stats["rows"] == 27
    assert report.flag_counts["stub_answer"] == 3 and report.flag_counts["empty_thinking"] == 3
    assert {s.sample_id for s in report.samples if "stub_answer" in s.flags} == {
        "demo-stub-001",
        "demo-stub-002",
        "demo-stub-003",
    }
    assert any("stub answers" in w for w in report.warnings)
    assert 0.5 < report.response_fraction < 0.95
    text = report.format_text(tok, n_examples=1)
    assert "hsstore quality gate: PASS" in text and "DOMINATES" not in text
    assert "--- demo-stub-001" in text


def test_clean_set_has_no_warnings(tok):
    samples = [s for s in load_samples(demo_conversations_path(), tok) if s.source != "legacy/stub"]
    report = check(samples)
    assert report.ok and not report.warnings and not report.flag_counts
    assert "no problems found" in report.format_text(tok)


def test_thresholds_decide(tok):
    # 3 of 31 demo samples share the smallest loss sum: fail once 9.7% is enough to "dominate".
    assert not demo_report(tok, GateThresholds(max_top_share=0.05)).ok
    assert not demo_report(tok, GateThresholds(max_stub_share=0.05)).ok
    assert demo_report(tok, GateThresholds(small_loss_sum=4, max_top_share=0.05)).ok


def test_duplicates_truncation_and_over_length(tok):
    samples = list(load_samples(demo_conversations_path(), tok, max_length=200, keep_over_length=True))
    dup = samples[0]
    samples += [
        TokenizedSample("copy", dup.input_ids.copy(), dup.loss_mask.copy(), dup.source, answer_tokens=dup.answer_tokens)
    ]
    cut = samples[1]
    samples += [
        TokenizedSample(
            "cut",
            cut.input_ids[:-5].copy(),
            cut.loss_mask[:-5].copy(),
            cut.source,
            flags=["truncated"],
            answer_tokens=9,
        )
    ]
    report = check(samples, GateThresholds(max_over_length_share=1.0))
    flags = {s.sample_id: s.flags for s in report.samples}
    assert "duplicate" in flags["copy"] and "duplicate" not in flags[dup.sample_id]
    assert "truncated" in flags["cut"]
    n_over = sum("over_length" in s.flags for s in samples)
    assert report.flag_counts["over_length"] == n_over > 0
    assert report.ok
    strict = check(samples, GateThresholds(max_over_length_share=0.05))
    assert not strict.ok and any("maximum length" in f for f in strict.failures)


def test_empty_input_fails():
    report = check([])
    assert not report.ok and report.failures == ["no samples to check"]
    assert "FAIL" in report.format_text()


# ---------------------------------------------------------------------------------------------- show


def test_format_sample_marks_masked_spans(tok):
    [s] = [x for x in load_samples(demo_conversations_path(), tok) if x.sample_id == "demo-stub-001"]
    plain = format_sample(tok, s.input_ids, s.loss_mask)
    assert plain.endswith("<|im_start|>assistant\n⟦<think>\n\n</think>\n\nOK.<|im_end|>⟧")
    assert plain.count("⟦") == 1 and "\x1b[" not in plain
    colored = format_sample(tok, s.input_ids, s.loss_mask, color=True)
    assert "\x1b[1;32m<think>\n\n</think>\n\nOK.<|im_end|>\x1b[0m" in colored and "⟦" not in colored
    short = format_sample(tok, s.input_ids, s.loss_mask, max_chars=40)
    assert short.startswith("[...] ") and short.endswith("OK.<|im_end|>⟧")


# ---------------------------------------------------------------------------------------------- CLI


def run_cli(capsys, *argv):
    code = hsstore_main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_check_exit_codes(capsys, tiny_dir, stub_file):
    demo = str(demo_conversations_path())
    code, out, _ = run_cli(capsys, "check", "--model", str(tiny_dir), "--input", demo)
    assert code == 0 and "PASS" in out
    code, out, _ = run_cli(capsys, "check", "--model", str(tiny_dir), "--input", str(stub_file), "--color", "never")
    assert code == 1 and "OF SAMPLES HAVE A LOSS-MASK SUM OF EXACTLY" in out and "⟦" in out
    code, out, _ = run_cli(capsys, "check", "--model", str(tiny_dir), "--input", str(stub_file), "--json")
    assert code == 1 and json.loads(out)["top_loss_sum"]["share"] == pytest.approx(0.87)
    code, out, _ = run_cli(capsys, "check", "--model", str(tiny_dir), "--input", demo, "--max-top-share", "0.05")
    assert code == 1
    code, out, _ = run_cli(capsys, "check", "--model", str(tiny_dir), "--input", demo, "--max-length", "200")
    assert code == 1 and "samples over the maximum length" in out


def test_cli_errors_are_one_line_and_exit_2(capsys, tiny_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("")
    code, out, err = run_cli(capsys, "check", "--model", str(tiny_dir), "--input", str(bad))
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "bad.jsonl: empty file" in err
    code, _, err = run_cli(capsys, "check", "--model", str(tmp_path / "nope"), "--input", str(bad))
    assert code == 2 and "model directory not found" in err


def test_cli_show(capsys, tiny_dir):
    demo = str(demo_conversations_path())
    code, out, _ = run_cli(capsys, "show", demo, "demo-multi-001#t1", "--model", str(tiny_dir), "--color", "never")
    assert code == 0
    assert out.startswith("# demo-multi-001#t1 [regen/math]")
    assert out.count("⟦") == 1 and "Diameter 3 means radius 1.5" in out
    code, out2, _ = run_cli(capsys, "show", demo, "18", "--model", str(tiny_dir), "--color", "never")
    assert code == 0 and out2 == out  # position 18 is the same sample
    code, _, err = run_cli(capsys, "show", demo, "999", "--model", str(tiny_dir))
    assert code == 2 and "it has 31 samples" in err


def test_register_mounts_subcommands_with_threshold_flags():
    parser = argparse.ArgumentParser(prog="hsstore")
    cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        ["check", "--model", "m", "--input", "a", "b", "--max-stub-share", "0.3", "--small-loss-sum", "16"]
    )
    assert args.func is cli.run_check and args.input == ["a", "b"]
    t = cli.thresholds_from_args(args)
    assert t == GateThresholds(max_stub_share=0.3, small_loss_sum=16)
    args = parser.parse_args(["show", "data.jsonl", "3", "--model", "m"])
    assert args.func is cli.run_show and args.n == "3"


def test_cli_module_does_not_import_transformers():
    """The `hsstore` CLI mounts extract's commands at startup; transformers must load only when they run."""
    code = "import sys, hsstore.app.cli, extract.cli; hsstore.app.cli.build_parser(); sys.exit(int('transformers' in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def test_cli_check_counts_skipped_rows_and_takes_template_kwargs(capsys, tiny_dir, tmp_path):
    rows = [json.loads(line) for line in demo_conversations_path().read_text().splitlines()]
    broken = {"id": "broken", "messages": [{"role": "user", "content": "no answer"}]}
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows + [broken]))
    base = ["check", "--model", str(tiny_dir), "--input", str(path), "--json"]
    code, out, _ = run_cli(capsys, *base, "--max-skipped-share", "0.1")
    report = json.loads(out)
    assert code == 0 and report["skipped"]["invalid_row"]["ids"] == ["broken"]
    assert report["skipped"]["invalid_row"]["first"].endswith("in.jsonl:28 (id=broken): conversation has no assistant turn")
    assert any("cannot be tokenized faithfully" in w for w in report["warnings"])
    code, out, _ = run_cli(capsys, *base)  # 1 of 28 rows > 2%: the gate fails, the JSON is still printed
    assert code == 1 and any("cannot be tokenized faithfully" in f for f in json.loads(out)["failures"])
    # Template arguments reach the template: the tiny template's thinking-off prompt does not continue
    # into the rows' reasoning, so every row is skipped as a prompt mismatch.
    code, out, _ = run_cli(capsys, *base, "--chat-template-kwargs", '{"enable_thinking": false}')
    report = json.loads(out)
    assert code == 1 and report["skipped"]["prompt_mismatch"]["count"] >= 20
    code, out, err = run_cli(capsys, *base, "--chat-template-kwargs", "{nope")
    assert code == 2 and out == "" and err.count("\n") == 1 and "--chat-template-kwargs" in err
