"""Every remote read is bounded by what hsstore expects to receive, whatever a server declares (docs/RELIABILITY.md,
"Boundaries"; hsstore/io/receive.py): a hostile HTTP server (hsstore.testing.hostile_http) and a hostile S3 endpoint
(moto's server behind hsstore.testing.faultproxy) on loopback, each command run as a user runs it, in a process of
its own: one line naming the object and the bound, within a deadline, in bounded memory; no redirect off the
store's origin, and no key or location that reads outside the store's prefix once percent-decoded."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import hsstore
from hsstore.format import commit
from hsstore.testing.faultproxy import FaultProxy
from hsstore.testing.hostile_http import HostileHTTPServer

from conftest import make_manifest, make_samples, write_samples

REPO = Path(__file__).resolve().parents[1]
COMMAND_S = 60  # a command on these tiny stores takes a few seconds; a hostile server would hold it for ever
RSS_MB = 700  # the most resident memory a command over a hostile server may reach (a plain `info` takes ~150 MB)

# VmHWM, not ru_maxrss: a child's ru_maxrss starts at its parent's high-water mark (the mm it was forked from), so a
# large pytest process would be charged to every command it starts
RUN = ("import sys\nfrom hsstore.app.cli import main\nrc = main(sys.argv[1:])\n"
       "hwm = [ln for ln in open('/proc/self/status') if ln.startswith('VmHWM:')][0].split()[1]\n"
       "print('PEAK_RSS_MB', int(hwm) // 1024, file=sys.stderr)\n"
       "sys.exit(rc)\n")


def hsstore_cmd(argv: list[str], timeout: float = COMMAND_S) -> tuple[int, str, list[str], int, float]:
    """(exit status, stdout, the lines of stderr that are not warnings, peak resident MB, seconds) of an hsstore
    command in a fresh process; killed (the test fails) past ``timeout``."""
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", RUN, *argv], capture_output=True, text=True, timeout=timeout, cwd=REPO)
    took = time.monotonic() - t0
    peak = int(r.stderr.rsplit("PEAK_RSS_MB", 1)[1].split()[0]) if "PEAK_RSS_MB" in r.stderr else -1
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith(("PEAK_RSS_MB", "WARNING"))
             and "%|" not in ln]
    return r.returncode, r.stdout, lines, peak, took


def one_line(rc, lines, peak, *words):
    assert rc == 2 and len(lines) == 1 and "Traceback" not in lines[0], lines
    assert all(w in lines[0] for w in words), lines[0]
    assert 0 < peak < RSS_MB, peak


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A folder served over HTTP: ``store`` (a small zarr store) and ``redirected/store`` (another store, served by
    another host: a redirect's target)."""
    d = tmp_path_factory.mktemp("served")
    write_samples(str(d / "store"), make_manifest(), make_samples(6, max_len=60))
    write_samples(str(d / "redirected" / "store"), make_manifest(), make_samples(3, max_len=60, prefix="other"))
    return d


# -- HTTP: what a server sends ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,words", [
    ("ignore_range", ["manifest.json", "larger than its bound of 1,048,576"]),
    ("huge_length", ["manifest.json", "declares 1,000,000,000,000 bytes, 1,048,577 were asked for"]),
    ("gzip", ["manifest.json", "Content-Encoding 'gzip'"]),
    ("trickle", ["manifest.json", "cut off after", "deadline"]),
    ("trickle_head", ["manifest.json", "cut off after", "deadline"]),
])
def test_info_over_a_hostile_http_server_is_one_line_in_bounded_time_and_memory(served, kind, words):
    with HostileHTTPServer(str(served), [(kind, lambda p: p.endswith("/store/manifest.json"))]) as srv:
        rc, _, lines, peak, took = hsstore_cmd(["info", f"{srv.url}/store"])
        assert srv.injected[kind] >= 1
    one_line(rc, lines, peak, *words)
    assert took < 40, took


def test_an_index_page_that_never_ends_is_one_line(served):
    with HostileHTTPServer(str(served), [("endless_index", lambda p: p.rstrip("/").endswith("/store/commits"))]) as srv:
        rc, _, lines, peak, took = hsstore_cmd(["info", f"{srv.url}/store"])
        assert srv.injected["endless_index"] >= 1
    one_line(rc, lines, peak, "commits/", "more than the 67,108,864 bytes a listing may take")


def test_a_listing_whose_headers_trickle_is_cut_at_the_first_bytes_deadline(served):
    """Found by the boundaries fuzzer: the headers of ``commits/``'s index page a byte a second held ``info`` for
    the page's whole deadline (64 MiB at 256 KiB/s: 266 s); the status and headers must come within the first byte's."""
    with HostileHTTPServer(str(served), [("trickle_head", lambda p: p.rstrip("/").endswith("/store/commits"))]) as srv:
        rc, _, lines, peak, took = hsstore_cmd(["info", f"{srv.url}/store"])
        assert srv.injected["trickle_head"] >= 1
    one_line(rc, lines, peak, "commits", "cut off after")
    assert took < 40, took


def test_an_index_segment_that_never_ends_costs_little_memory(served):
    """Found by the boundaries fuzzer: an HTTP listing gives no sizes, so an index segment was read up to its kind's
    cap (512 MiB: +1.1 GB); now the length its server's HEAD declares, or at most 64 MiB when it declares none. The
    segment is then set aside and the records read."""
    with HostileHTTPServer(str(served), [("ignore_range", lambda p: "/store/index/" in p and p.endswith(".idx"))]) as srv:
        rc, out, lines, peak, _ = hsstore_cmd(["info", f"{srv.url}/store"])
        assert srv.injected["ignore_range"] >= 1
    assert rc == 0 and "samples" in out, (rc, lines)
    assert 0 < peak < 400, peak


@pytest.mark.parametrize("declared", [True, False], ids=["length", "no_length"])
def test_an_http_object_is_asked_its_size_once(served, declared):
    """An HTTP listing gives no sizes, so an object read whole is sized by its server's HEAD; where the HEAD
    declares no length, that answer holds for the read (capped at ``receive.UNDECLARED_CAP``), never asked again:
    each object is HEADed at most once as a store opens, an index segment (its head checked first) and each commit
    record exactly once."""
    with HostileHTTPServer(str(served), [("no_length", lambda p: "/store/" in p)] if not declared else []) as srv:
        store = hsstore.open(f"{srv.url}/store")
        assert len(store) == 6
        assert declared or srv.injected["no_length"] >= 1
    heads = dict(srv.heads)
    segments = [p for p in heads if "/store/index/" in p]
    records = [p for p in heads if "/store/commits/" in p]
    assert segments and len(records) == len(store.commits), heads
    assert set(heads.values()) == {1}, heads


def test_a_redirect_to_another_host_is_not_followed(served):
    """Every path of the store redirects to the same path on another host, which holds another store there."""
    with HostileHTTPServer(str(served / "redirected")) as other:
        with HostileHTTPServer(str(served), [("redirect", lambda p: "/store/" in p)], redirect_to=other.url) as srv:
            rc, out, lines, peak, _ = hsstore_cmd(["info", f"{srv.url}/store"])
        asked = list(other.paths)
    one_line(rc, lines, peak, "manifest.json", "302 redirects to", "not followed")
    assert not asked, asked  # nothing was asked of the other host


# -- HTTP: names that leave the store once percent-decoded --------------------------------------------------------
def _outside_requests(srv, prefix="/store/") -> list[str]:
    return [p for p in srv.paths if not p.startswith(prefix)]


@pytest.fixture
def dotted_store(served, tmp_path):
    """A copy of ``store`` whose first record lists one more file, ``shards/<shard>/layer_001/c/%2e%2e/...`` that
    an HTTP server decodes to a path outside the store, holding a copy of a real chunk (size and CRC32C as listed):
    what verify would call OK and merge would copy."""
    root = tmp_path / "root"
    shutil.copytree(served / "store", root / "store")
    (root / "elsewhere").mkdir()
    store = hsstore.open(str(root / "store"))
    rec = store.commits[0]
    key = next(k for k in rec.files if "/layer_001/c/" in k)
    shutil.copy(root / "store" / key, root / "elsewhere" / "chunk")
    forged = f"shards/{rec.shard}/layer_001/c/" + "%2e%2e/" * 5 + "elsewhere/chunk"
    d = json.loads((root / "store" / commit.commit_path(rec.shard)).read_text())
    d["files"][forged] = dict(d["files"][key])
    (root / "store" / commit.commit_path(rec.shard)).write_text(json.dumps(d))
    shutil.rmtree(root / "store" / "index")
    return root, rec.shard, forged


def test_verify_refuses_a_percent_encoded_dot_segment_file_key(dotted_store):
    root, shard, forged = dotted_store
    with HostileHTTPServer(str(root)) as srv:
        rc, out, lines, peak, _ = hsstore_cmd(["verify", f"{srv.url}/store", "-q"])
        outside = _outside_requests(srv)
    fails = [ln for ln in out.splitlines() if ln.startswith("FAIL")]
    assert rc == 1 and len(fails) == 1 and f"shard {shard}" in fails[0] and "percent-encoded" in fails[0], out
    assert not outside, outside


def test_merge_never_copies_a_percent_encoded_dot_segment_file_key(dotted_store, tmp_path):
    root, shard, forged = dotted_store
    with HostileHTTPServer(str(root)) as srv:
        rc, _, lines, peak, _ = hsstore_cmd(["merge", str(tmp_path / "dst"), f"{srv.url}/store", "-q"])
        outside = _outside_requests(srv)
    one_line(rc, lines, peak, "percent-encoded")
    assert not outside, outside
    assert not list((tmp_path / "dst").rglob("chunk"))


def test_a_percent_encoded_location_is_never_followed(served, tmp_path):
    """A record whose shard lives, by its ``location``, at ``%2e%2e/other``: inside the store as text, a sibling
    folder once a server decodes it."""
    root = tmp_path / "root"
    shutil.copytree(served / "store", root / "store")
    store = hsstore.open(str(root / "store"))
    rec = store.commits[0]
    shutil.copytree(root / "store" / "shards" / rec.shard, root / "other" / "shards" / rec.shard)
    shutil.rmtree(root / "store" / "shards" / rec.shard)
    d = json.loads((root / "store" / commit.commit_path(rec.shard)).read_text())
    d["location"] = "%2e%2e/other"
    (root / "store" / commit.commit_path(rec.shard)).write_text(json.dumps(d))
    shutil.rmtree(root / "store" / "index")
    with HostileHTTPServer(str(root)) as srv:
        rc, out, _, _, _ = hsstore_cmd(["verify", f"{srv.url}/store", "-q"])
        rc2, _, lines, peak, _ = hsstore_cmd(["merge", str(tmp_path / "dst"), f"{srv.url}/store", "-q"])
        outside = _outside_requests(srv)
    fails = [ln for ln in out.splitlines() if ln.startswith("FAIL")]
    assert rc == 1 and any(f"shard {rec.shard}" in f and "location not followed" in f for f in fails), out
    one_line(rc2, lines, peak, "location", "percent-encoded")
    assert not outside, outside


# names an index page links to that decode to another folder than the one listed (each beside a good one)
DOTTED_LINKS = {"%2e%2e": "..", "%2e%2e/": "../", "..%2F": "../", ".%2e/": "../", "%2F": "/", "%2F%2F": "//",
                "%2e": ".", "%2e/": "./", "a%2Fb.json": "a/b.json", "%2e%2e%2Fsecret.json": "../secret.json",
                "sub%2F..%2F..%2Fx": "sub/../../x"}


class _IndexPage(BaseHTTPRequestHandler):
    """An HTML index page at ``/store/commits/`` linking to every name of DOTTED_LINKS, one good file and one good
    folder; anything else is 404."""

    def log_message(self, *a) -> None:
        pass

    def do_GET(self) -> None:
        if self.path != "/store/commits/":
            self.send_error(404)
            return
        links = ["ok.json", "folder/", *DOTTED_LINKS]
        body = "".join(f'<a href="{href}">{href}</a>\n' for href in links).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_an_index_page_names_nothing_outside_its_folder_once_decoded():
    """Links that percent-decode to ``/``, ``.``, ``..``, ``../`` or a name holding a slash are no names of the
    folder listed: a listing never hands them on (a reader would take ``commits/../x`` for a record)."""
    from hsstore.io import listing, storage

    server = ThreadingHTTPServer(("127.0.0.1", 0), _IndexPage)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        fs, root = storage.resolve(f"http://127.0.0.1:{server.server_address[1]}/store")
        names = listing.list_names(fs, f"{root}/commits")
        detail = listing.list_detail(fs, f"{root}/commits")
    finally:
        server.shutdown()
        server.server_close()
    assert names == ["folder", "ok.json"], names
    assert list(detail) == ["ok.json"], detail


class _DrippedIndexPage(BaseHTTPRequestHandler):
    """An index page of ``size`` bytes (its length declared) sent in pieces of ``piece`` bytes at ``rate`` bytes a
    second: each piece comes quickly, the whole answer slower than the rate a reader takes. ``sent``: bytes sent."""

    size, piece, rate, sent = 32 << 10, 64, 1000.0, 0

    def log_message(self, *a) -> None:
        pass

    def do_GET(self) -> None:
        link = b'<a href="rec-0000000000.json">rec-0000000000.json</a>\n'
        body = (link * (self.size // len(link) + 1))[:self.size]
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        t0 = time.monotonic()
        try:
            for at in range(0, len(body), self.piece):
                self.wfile.write(body[at:at + self.piece])
                type(self).sent += len(body[at:at + self.piece])
                time.sleep(max(0.0, t0 + (at + self.piece) / self.rate - time.monotonic()))
        except OSError:  # cut off, as it should be
            pass


@pytest.mark.slow  # seconds of a dripped answer
def test_an_answer_just_under_the_minimum_rate_in_many_small_pieces_is_cut(monkeypatch):
    """A page whose pieces arrive every few milliseconds at 0.8 x the minimum rate: no gap is long, so only the
    whole answer's clock (its first byte within HSSTORE_REQUEST_S, then the minimum rate on average) cuts it, at
    about REQUEST_S / (1 - 0.8) seconds; the page's own deadline (its 64 MiB bound at that rate) is hours away."""
    from hsstore import env
    from hsstore.io import listing, storage
    from hsstore.io.receive import DeadlineError

    monkeypatch.setenv(env.REQUEST_S.name, "1")
    monkeypatch.setenv(env.MIN_RATE.name, "4096")
    handler = type("Dripped", (_DrippedIndexPage,), {"rate": 0.8 * 4096, "sent": 0})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        fs, root = storage.resolve(f"http://127.0.0.1:{server.server_address[1]}/store")
        cut = r"/store/commits/?: cut off after [0-9.]+ s with [0-9,]+ bytes .*on average"
        with pytest.raises(DeadlineError, match=cut):
            listing.list_names(fs, f"{root}/commits")
    finally:
        server.shutdown()
        server.server_close()
    assert 0 < handler.sent < handler.size, handler.sent  # cut part way, not read to its end


# -- S3: a hostile endpoint in front of moto's server ---------------------------------------------------------------
@pytest.fixture
def s3_small(s3_store):
    url, opts = s3_store
    write_samples(url, make_manifest(), make_samples(6, max_len=60), storage_options=opts)
    return url, opts["endpoint_url"]


def _s3(argv: list[str], proxy) -> list[str]:
    return [*argv, "-S", f"endpoint_url={proxy.url}"]


def test_info_over_a_trickling_s3_endpoint_is_cut_off(s3_small):
    url, endpoint = s3_small
    with FaultProxy(endpoint, faults=["trickle"], persistent=True,
                    match=lambda m, p: m == "GET" and p.split("?")[0].endswith("/manifest.json")) as proxy:
        rc, _, lines, peak, took = hsstore_cmd(_s3(["info", url], proxy))
        assert proxy.injected["trickle"] >= 1
    one_line(rc, lines, peak, "manifest.json", "cut off after", "deadline")
    assert took < 40, took


def test_an_s3_answer_redirected_to_another_endpoint_is_refused(s3_small, tmp_path):
    """The endpoint answers the manifest's GET with a redirect to another host, which serves another store's
    manifest at the same key, to anyone. botocore's HTTP client follows it; the answer is refused."""
    url, endpoint = s3_small
    key = url.removeprefix("s3://")
    write_samples(str(tmp_path / "other" / key), make_manifest(), make_samples(3, max_len=60, prefix="other"))
    with HostileHTTPServer(str(tmp_path / "other")) as other:
        with FaultProxy(endpoint, faults=["redirect"], persistent=True, redirect_to=other.url,
                        match=lambda m, p: m == "GET" and p.split("?")[0].endswith("/manifest.json")) as proxy:
            rc, _, lines, peak, _ = hsstore_cmd(_s3(["info", url], proxy))
            assert proxy.injected["redirect"] >= 1
        followed = [p for p in other.paths if p.endswith("/manifest.json")]
    assert followed  # the client went there: only the origin check stands between it and that answer
    one_line(rc, lines, peak, "manifest.json", "redirected to '127.0.0.1'", "its own endpoint only")


def test_a_chunk_body_past_its_size_is_cut_and_refused(s3_small):
    url, endpoint = s3_small
    with FaultProxy(endpoint, faults=["overrun"], persistent=True,
                    match=lambda m, p: m == "GET" and "/layer_" in p and "/c/" in p) as proxy:
        rc, out, lines, peak, took = hsstore_cmd(_s3(["verify", url, "-q"], proxy))
        assert proxy.injected["overrun"] >= 1
    fails = [ln for ln in out.splitlines() if ln.startswith("FAIL")]
    assert rc == 1 and fails and all("more than the" in f and "bytes asked for; cut" in f for f in fails), (out, lines)
    assert 0 < peak < RSS_MB and took < 40, (peak, took)


def test_a_chunk_declaring_a_terabyte_is_refused_unread(s3_small):
    url, endpoint = s3_small
    with FaultProxy(endpoint, faults=["huge_length"], persistent=True,
                    match=lambda m, p: m == "GET" and "/layer_" in p and "/c/" in p) as proxy:
        rc, out, lines, peak, _ = hsstore_cmd(_s3(["verify", url, "-q"], proxy))
    fails = [ln for ln in out.splitlines() if ln.startswith("FAIL")]
    assert rc == 1 and fails and all("declares 1,000,000,000,000 bytes" in f for f in fails), (out, lines)
    assert 0 < peak < RSS_MB, peak


def test_an_s3_listing_that_never_ends_is_one_line(s3_small):
    url, endpoint = s3_small
    with FaultProxy(endpoint, faults=["endless_list"], persistent=True,
                    match=lambda m, p: m == "GET" and "list-type=2" in p and "commits" in p) as proxy:
        rc, _, lines, peak, took = hsstore_cmd(_s3(["info", url], proxy))
        assert proxy.injected["endless_list"] >= 1
    one_line(rc, lines, peak, "listing of", "commits/", "endless listing")
    assert took < 40, took
