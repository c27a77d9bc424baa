"""Progress in a batch job's log (``hsstore.progress``): where stderr is not a terminal, a plain line every
``HSSTORE_PROGRESS_S`` seconds and at the end, never a carriage return; ``train`` logs a loss line every
``--log-every`` steps, with ``-q`` too."""

from __future__ import annotations

import io
import re
import time

from hsstore.app.cli import main
from hsstore.progress import LineFile, progress_bar

from train_helpers import small_input, store32  # noqa: F401  (fixtures)


def test_a_bar_into_a_file_is_a_line_every_interval(monkeypatch):
    monkeypatch.setenv("HSSTORE_PROGRESS_S", "0.05")
    log = io.StringIO()
    with progress_bar(total=20, desc="work", unit="step", file=log) as bar:
        for _ in range(20):
            time.sleep(0.01)
            bar.update(1)
    text = log.getvalue()
    lines = text.splitlines()
    assert "\r" not in text and text.endswith("\n")
    assert 2 <= len(lines) <= 12, lines  # the first, about one per 0.05 s, the last
    assert all(ln.startswith("work: ") for ln in lines), lines
    assert "20/20" in lines[-1] and "100%" in lines[-1]


def test_the_line_stream_writes_each_redraw_once():
    out = io.StringIO()
    f = LineFile(out)
    f.write("\rverify:  10%| 1/10")
    f.write("\rverify: 100%| 10/10   ")
    f.write("\n")
    f.write("\r")
    assert out.getvalue() == "verify:  10%| 1/10\nverify: 100%| 10/10\n"


def test_verify_into_a_log_has_no_carriage_return(tmp_path, new_manifest, new_samples, write, capsys):
    """Through the command, stderr captured (not a terminal): its progress is plain lines."""
    url = str(tmp_path / "s")
    write(url, new_manifest(), new_samples(6))
    assert main(["verify", url]) == 0
    err = capsys.readouterr().err
    assert "\r" not in err
    assert any(ln.startswith("verify: 100%") for ln in err.splitlines()), err


def test_train_quiet_logs_a_loss_line_every_log_every_steps(store32, tmp_path, caplog):  # noqa: F811
    argv = ["train", "--store", store32, "--out", str(tmp_path / "run"), "--steps", "4", "--log-every", "2",
            "--draft-layers", "1", "--block-size", "8", "--anchors", "8", "--device", "cpu", "-q"]
    with caplog.at_level("INFO", logger="hsstore.train"):
        assert main(argv) == 0
    lines = [r.getMessage() for r in caplog.records if re.match(r"step \d+/\d+ ", r.getMessage())]
    assert [ln.split(" (")[0] for ln in lines] == ["step 2/4", "step 4/4"], lines
    assert all("loss " in ln and "tokens/s" in ln and "lr " in ln for ln in lines), lines
