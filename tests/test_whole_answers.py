"""Remote answers bounded as a whole by what hsstore expects of them (hsstore/io/door.py, receive.py): a large
object whose first bytes say what it is (an index segment) has them checked before the rest is asked for, so junk
planted in a store costs its head, not minutes at a rate just above the minimum; and the bytes past what a record
or range asks for are never waited for. Commands run as a user runs them, against a hostile HTTP server."""

from __future__ import annotations

import os

import pytest

from hsstore.format import index
from hsstore.testing.hostile_http import HostileHTTPServer

from conftest import make_manifest, make_samples, write_samples
from test_hostile_transport import hsstore_cmd

RATE = 64 << 10  # the clients' minimum rate in these tests (HSSTORE_MIN_RATE): the server sends a little above it


@pytest.fixture
def planted(tmp_path):
    """A small store served over HTTP, with 8 MiB of junk planted as an index segment."""
    write_samples(str(tmp_path / "store"), make_manifest(), make_samples(6, max_len=60))
    junk = tmp_path / "store" / index.INDEX_DIR / "w-20990101T000000Z-junk-0badf00d.idx"
    junk.write_bytes(os.urandom(8 << 20))
    return tmp_path, junk.name


def test_junk_planted_as_an_index_segment_costs_its_head_not_minutes(planted, monkeypatch):
    """Found by the review: a server sending just above the minimum rate held `info` for minutes over one planted
    64 MiB segment, refused only once all of it had arrived. Now its head is read first and the rest never asked for;
    the segment is set aside and the records read."""
    root, name = planted
    monkeypatch.setenv("HSSTORE_MIN_RATE", str(RATE))
    with HostileHTTPServer(str(root), [("slow", lambda p: p.endswith(name))], rate=1.25 * RATE) as srv:
        rc, out, lines, peak, took = hsstore_cmd(["info", f"{srv.url}/store"])
        sent = srv.sent[f"/store/{index.INDEX_DIR}/{name}"]
    assert rc == 0 and "samples" in out, (rc, lines)
    assert sent <= 2 << 20, sent  # its head (and what was in flight), never the 8 MiB
    assert took < 40, took


def test_the_bytes_past_a_records_size_are_never_waited_for(tmp_path):
    """Chunks answered with exactly the bytes asked for, no length, the connection held open: each read ends when
    the bytes its record lists are in (main: every chunk waited for its deadline, then failed as cut off)."""
    write_samples(str(tmp_path / "store"), make_manifest(), make_samples(6, max_len=60))
    with HostileHTTPServer(str(tmp_path), [("stall", lambda p: "/shards/" in p and "/c/" in p)]) as srv:
        rc, out, lines, _, took = hsstore_cmd(["verify", f"{srv.url}/store", "-q"])
        assert srv.injected["stall"] >= 1
    assert rc == 0 and "OK" in out, (out, lines)
    assert took < 40, took
