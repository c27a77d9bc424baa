"""`hsstore report`: a store's and a run's page render in a real browser (Debian's headless Chromium), every
chart with marks that have an area after layout, and the page needs nothing from outside the file."""

import json
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

import hsstore

from hsstore.cli import main
from hsstore.extract.job import ExtractConfig, run_extract
from train_helpers import small_input  # noqa: F401  (fixture)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (.ci/run installs it)")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
STORE_CHARTS = {"loss_sum_histogram", "length_histogram", "response_fraction", "flags", "bytes_per_layer"}
RUN_CHARTS = {"loss", "tau", "acc", "acc_k", "val_acceptance", "tokens_per_s", "lr"}


def chromium(page: Path, tmp_path: Path, *args: str) -> str:
    profile = tmp_path / f"profile-{len(list(tmp_path.iterdir()))}"
    profile.mkdir()
    r = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args, page.resolve().as_uri()],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


class Charts(HTMLParser):
    """Each <svg class="chart">: its name and the marks the page's script counted after layout."""

    def __init__(self):
        super().__init__()
        self.drawn: dict[str, int] = {}
        self.external: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "svg" and "chart" in (a.get("class") or "").split():
            self.drawn[a["data-chart"]] = int(a.get("data-drawn", "-1"))
        for k in ("src", "href"):
            if a.get(k) and not a[k].startswith("#"):
                self.external.append(a[k])


def drawn(dom: str) -> Charts:
    p = Charts()
    p.feed(dom)
    return p


@pytest.fixture(scope="module")
def stub_store(tiny_dir, small_input, tmp_path_factory):  # noqa: F811
    """A store where most samples are stubs (loss-mask sum 6), as in the seeds' data set."""
    rows = [json.loads(line) for line in Path(small_input).read_text().splitlines()]
    for r in rows[:6]:
        r["messages"][-1] = {"role": "assistant", "content": "<think>\n\n</think>\n\nOK."}
    src = tmp_path_factory.mktemp("stubs") / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path_factory.mktemp("store") / "s"
    run_extract(ExtractConfig(model=str(tiny_dir), inputs=[str(src)], out=str(out), device="cpu", progress=False,
                              force=True))
    return out


@needs_chromium
def test_store_report_renders(stub_store, tmp_path, capsys):
    page = tmp_path / "store.html"
    assert main(["report", str(stub_store), "--out", str(page)]) == 0
    text = page.read_text()
    assert "stub answers?" in text  # the warning of `hsstore info`, on top
    p = drawn(chromium(page, tmp_path, "--dump-dom"))
    per_feature = {f"rms_{f}" for f in hsstore.open(str(stub_store)).manifest.all_features}  # RMS per shard
    assert set(p.drawn) == STORE_CHARTS | per_feature and all(n > 0 for n in p.drawn.values()), p.drawn
    assert p.external == []
    shot = tmp_path / "store.png"
    chromium(page, tmp_path, f"--screenshot={shot}", "--window-size=1400,1100")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get("HSSTORE_REPORT_SCREENSHOT"):  # keep a picture to look at
        shutil.copy(shot, os.environ["HSSTORE_REPORT_SCREENSHOT"])


@needs_chromium
def test_run_report_renders(stub_store, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--store", str(stub_store), "--out", str(run), "--steps", "4", "--val-store",
                 str(stub_store), "--val-every", "2", "--token-budget", "1024", "--draft-layers", "1",
                 "--block-size", "8", "--anchors", "32", "--log-every", "1", "--device", "cpu", "-q"]) == 0
    page = tmp_path / "run.html"
    assert main(["report", str(run), "--out", str(page)]) == 0
    p = drawn(chromium(page, tmp_path, "--dump-dom"))
    assert set(p.drawn) == RUN_CHARTS and all(n > 0 for n in p.drawn.values()), p.drawn
    # the loss chart: one line over the 4 training steps and a dot per validation (steps 2 and 4)
    svg = re.search(r'<svg class="chart" data-chart="loss".*?</svg>', page.read_text(), re.S).group(0)
    assert svg.count('class="mark series"') == 1 and svg.count('class="mark point"') == 2


def test_report_refuses_what_is_neither(tmp_path, capsys):
    (tmp_path / "x").mkdir()
    assert main(["report", str(tmp_path / "x"), "--out", str(tmp_path / "r.html")]) == 2
    assert "not an hsstore store" in capsys.readouterr().err
    assert not (tmp_path / "r.html").exists()
