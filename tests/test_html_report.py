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
from hsstore import env

from hsstore.app.cli import main
from hsstore.extract.job import ExtractSettings, run_extract
from hsstore.app.schema import build
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
    run_extract(build(ExtractSettings, model=str(tiny_dir), input=[str(src)], out=str(out), device="cpu",
                      progress=False, force=True))
    return out


@pytest.mark.browser
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
    keep = env.REPORT_SCREENSHOT.get()
    if keep:  # a picture to look at
        shutil.copy(shot, keep)


@pytest.mark.browser
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


def test_report_refuses_a_file_it_did_not_write(tmp_path, capsys):
    """#38.1: --out follows every writing command's destination rule: a file of the user's is refused (one
    line, left as it was, before the store is read); a page `report` wrote before is replaced."""
    from conftest import make_manifest, make_samples, write_samples

    store = tmp_path / "s"
    write_samples(str(store), make_manifest(), make_samples(4))
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    assert main(["report", str(store), "--out", str(notes)]) == 2
    err = capsys.readouterr().err
    assert "exists and is not a report hsstore wrote" in err and len(err.strip().splitlines()) == 1
    assert notes.read_text() == "my notes\n"
    (tmp_path / "folder").mkdir()
    assert main(["report", str(store), "--out", str(tmp_path / "folder")]) == 2
    assert "is a folder" in capsys.readouterr().err
    page = tmp_path / "r.html"
    assert main(["report", str(store), "--out", str(page)]) == 0
    first = page.stat().st_mtime_ns
    assert main(["report", str(store), "--out", str(page)]) == 0  # its own page: replaced
    assert page.stat().st_mtime_ns >= first and "hsstore store report" in page.read_text()
    fifo = tmp_path / "pipe.html"  # read through the door: refused at once, never waited on
    os.mkfifo(fifo)
    assert main(["report", str(store), "--out", str(fifo)]) == 2
    assert "a FIFO, not a regular file" in capsys.readouterr().err
    link = tmp_path / "link.html"  # a link to a page of its own is not followed either
    link.symlink_to(page)
    assert main(["report", str(store), "--out", str(link)]) == 2
    assert "symbolic link" in capsys.readouterr().err and "hsstore store report" in page.read_text()


def _charts(page: Path) -> dict[str, str]:
    text = page.read_text()
    return {re.search(r'data-chart="([^"]+)"', svg).group(1): svg for svg in re.findall(r"<svg.*?</svg>", text, re.S)}


def _texts(svg: str, cls: str) -> list[str]:
    return re.findall(rf'class="{cls}"[^>]*>([^<]*)<', svg)


def _store_with_loss_sums(path: Path, sums: list[int]) -> None:
    import torch

    from conftest import make_manifest, write_samples

    samples = []
    for i, n in enumerate(sums):
        T = n + 20
        mask = torch.zeros(T, dtype=torch.bool)
        mask[20:] = True
        samples.append({"sample_id": f"s{i}", "input_ids": torch.arange(T) % 500, "loss_mask": mask,
                        "hidden_states": torch.randn(T, 3, 48).to(torch.bfloat16)})
    write_samples(str(path), make_manifest(), samples)


def test_store_charts_have_readable_axes_and_red_only_for_a_dominating_value(tmp_path, capsys):
    """#38.14: 4-7 round ticks per axis (5-6 where steps of 1, 2, 2.5, 5 allow), in the header's units (bytes as
    KB/MB, never 7.34e+06); the top loss-sum bin in red only when one value dominates (the stub signature)."""
    healthy, stubs = tmp_path / "healthy", tmp_path / "stubs"
    _store_with_loss_sums(healthy, [40 + (i * 7) % 90 for i in range(60)])  # top value ~3%: healthy
    _store_with_loss_sums(stubs, [6] * 50 + [80 + i for i in range(10)])   # 83% exactly 6: stubs
    for store in (healthy, stubs):
        assert main(["report", str(store), "--out", str(tmp_path / f"{store.name}.html")]) == 0
    good, bad = _charts(tmp_path / "healthy.html"), _charts(tmp_path / "stubs.html")
    for name, svg in good.items():
        ticks = _texts(svg, "ytick")
        assert 4 <= len(ticks) <= 7, (name, ticks)
        assert not any("e+" in t or "e-" in t for t in ticks), (name, ticks)
    assert all(t.endswith((" KB", " MB", " B")) for t in _texts(good["bytes_per_layer"], "ytick"))
    assert "#d62728" not in good["loss_sum_histogram"] and "stub answers?" not in (tmp_path / "healthy.html").read_text()
    assert 'stroke="#222"' in good["loss_sum_histogram"]  # the top value's bin is still marked, not alarmed
    assert bad["loss_sum_histogram"].count('fill="#d62728"') == 1 and "stub answers?" in (tmp_path / "stubs.html").read_text()


def test_run_charts_have_step_ticks_and_a_legend_for_two_series(tmp_path, capsys):
    """#38.14: step numbers along the x axis (round ones), and a legend naming train and val where both are
    drawn in one chart; a chart of one series needs none."""
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": s, "loss": 4.0 / s ** 0.3, "tau": 1 + s / 100, "acc": s / 1000, "lr": 3e-3 * (1 - s / 600),
             "tokens_per_s": 20000 + 10 * s} for s in range(50, 501, 50)]
    for r in rows[4::5]:
        r.update(val_loss=r["loss"] * 1.1, val_tau=r["tau"] - 0.2, val_acc=r["acc"] * 0.9)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    page = tmp_path / "run.html"
    assert main(["report", str(run), "--out", str(page)]) == 0
    charts = _charts(page)
    for name in ("loss", "tau", "acc", "lr", "tokens_per_s"):
        steps = [int(t.replace(",", "")) for t in _texts(charts[name], "xtick")]
        assert 4 <= len(steps) <= 7 and all(50 <= s <= 500 and s % 50 == 0 for s in steps), (name, steps)
        assert "step" in _texts(charts[name], "xtitle")
        ticks = _texts(charts[name], "ytick")
        assert 4 <= len(ticks) <= 7 and not any("e-" in t or "e+" in t for t in ticks), (name, ticks)
    legend = re.findall(r'<g class="legend">.*?<text[^>]*>([^<]*)</text></g>', charts["loss"])
    assert legend == ["train", "val"]
    assert "legend" not in charts["lr"]
