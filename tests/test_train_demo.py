"""``hsstore demo`` runs end to end (extraction, training from the store alone, eval), and never deletes a
folder it did not create."""

import json

import pytest

from hsstore.extract.demo import MARKER, note_created, prepare_out, run_demo
from hsstore.app.cli import main as hsstore_cli


@pytest.mark.slow
def test_demo_end_to_end(tmp_path, capsys):
    out = tmp_path / "demo"
    assert run_demo(out, train_steps=20, eval_samples=2) == 0  # short: tests/test_demo_learns.py checks learning
    captured = capsys.readouterr()
    text = captured.out
    # #53.8: the steps that take minutes show their progress (train ran with -q: nothing for 577 s)
    assert "train: 100%" in captured.err and "20/20" in captured.err and "extract rank 0: 100%" in captured.err
    assert "=== 7/7" in text and "trained 20 steps" in text
    assert "speculative output == target greedy output: 2/2" in text
    assert "$ hsstore extract --model" in text and "$ hsstore train --store" in text  # the commands it ran
    assert "What the numbers mean" in text and str(out / "store") in text
    assert "[extract: " in text and "[train: " in text and ", eval " in text.split("demo done in")[1]  # step times
    assert (out / "target" / "model.safetensors").exists()  # put back after training
    assert json.loads((out / MARKER).read_text())["created"]
    for page, chart in (("store.html", 'data-chart="loss_sum_histogram"'), ("run.html", 'data-chart="tau"')):
        assert chart in (out / page).read_text()  # hsstore report's pages (tests/test_html_report.py renders them)


def test_demo_device_is_chosen_and_said(monkeypatch):
    """``--device`` is taken as given; left out, the CPU without a GPU, and beside a GPU the device whose measured
    demo ran faster, with the figures in the reason (as ``extract`` says why it compiles or not)."""
    import torch

    from hsstore.extract import demo

    assert demo.choose_device("cpu") == ("cpu", "--device")
    monkeypatch.setattr(demo, "resolve_device", lambda spec=None: torch.device(spec or "cuda", 0 if not spec else None))
    monkeypatch.setattr(demo, "describe", lambda dev: "cuda:0 (a GPU)")
    dev, why = demo.choose_device(None)
    assert dev == "cpu" and "289s" in why and "119s" in why and "--device cuda" in why
    monkeypatch.setitem(demo.MEASURED_SECONDS, "cuda", 60.0)
    dev, why = demo.choose_device(None)
    assert dev == "cuda:0" and "60s on a GPU machine" in why


def test_demo_refuses_a_folder_it_did_not_create(tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    assert hsstore_cli(["demo", "--out", str(out)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert (out / "thesis.tex").read_text() == "years of work" and sorted(p.name for p in out.iterdir()) == [
        "thesis.tex"]


def test_demo_rerun_removes_only_what_it_created(tmp_path):
    out = tmp_path / "demo"
    prepare_out(out)
    for name in ("store", "run"):
        (out / name).mkdir()
        (out / name / "x").write_text("old")
    note_created()  # what the demo's steps record of the files they wrote
    (out / "notes.txt").write_text("mine")  # added by the user after the first run
    prepare_out(out)
    assert sorted(p.name for p in out.iterdir()) == sorted([MARKER, "notes.txt"])
    assert (out / "notes.txt").read_text() == "mine"


def test_demo_marker_cannot_name_other_paths(tmp_path):
    out = tmp_path / "demo"
    out.mkdir()
    (tmp_path / "outside").mkdir()
    (out / MARKER).write_text(json.dumps({"created": ["../outside", "/etc", "data"]}))
    prepare_out(out)
    assert (tmp_path / "outside").exists()


def test_demo_accepts_an_empty_folder(tmp_path):
    prepare_out(tmp_path)
    assert (tmp_path / MARKER).exists()


def test_demo_refuses_a_file(tmp_path):
    f = tmp_path / "f"
    f.write_text("x")
    with pytest.raises(ValueError, match="not a folder"):
        prepare_out(f)
