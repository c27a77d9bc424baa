"""Strings for people: a store's strings (sample ids, sources, flags, names, a writer's host) reach a terminal or a
log line escaped, so a newline in one never starts a forged line and invisible characters (format characters such
as the zero-width space, the tag block, private-use code points) never hide in what a person reads, while visible
non-ASCII text is shown as it is; two sample ids a person cannot tell apart are refused where they are written and
named by ``verify``."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest
import torch

from hsstore.app.cli import main
from hsstore.format import sessions
from hsstore.format.assets import write_assets
from hsstore.io import storage
from hsstore.loader.follow import Follow, Journal, Leader
from hsstore.store.reader import Store
from hsstore.store.writer import StoreWriter
from hsstore.terminal import EscapingFilter

from conftest import make_manifest, make_samples

FORGED = "\n!!! verify OK"  # a line of its own, if printed raw
HIDDEN = {"\u200b": "\\u200b", "\U000e0041": "\\U000e0041", "\U000e0042": "\\U000e0042", "\ue000": "\\ue000",
          "\u2060": "\\u2060", "\ufeff": "\\ufeff"}  # zero-width space, tags "AB", private use, word joiner, BOM
VISIBLE = "caf\u00e9 \u4e2d\u6587 \U0001F469\u200d\U0001F4BB"  # accents, CJK, an emoji joined by a ZWJ
HOSTILE = "x" + FORGED + "".join(HIDDEN) + VISIBLE


def assert_safe(out: str) -> None:
    """No forged line, every invisible character written as its escape, the visible text as it is."""
    assert not any(line.lstrip().startswith("!!! verify OK") for line in out.splitlines()), out
    assert "\\n!!! verify OK" in out, out
    assert all(raw not in out and esc in out for raw, esc in HIDDEN.items()), ascii(out)
    assert VISIBLE in out, ascii(out)


def tokenizer_assets(url: str, tiny_dir) -> None:
    fs, root = storage.resolve(url)
    write_assets(fs, root, {f"tokenizer/{p.name}": p.read_bytes() for p in Path(tiny_dir).iterdir()
                            if p.name.startswith(("tokenizer", "special_tokens", "chat_template"))})


def hostile_store(tmp_path: Path, tiny_dir) -> str:
    """One sample whose id, source and flag, and whose manifest's target name, hold HOSTILE; the tokenizer beside."""
    url = str(tmp_path / "s")
    m = make_manifest()
    m = dataclasses.replace(m, target=dataclasses.replace(m.target, name="tgt" + HOSTILE))
    s = make_samples(1, max_len=40)[0]
    with StoreWriter(url, m) as w:
        w.add("id" + HOSTILE, s["input_ids"] % 100, s["loss_mask"], s["hidden_states"], source="src" + HOSTILE,
              flags=["flag" + HOSTILE])
    tokenizer_assets(url, tiny_dir)
    return url


def test_info_show_and_verify_escape_every_store_string(tmp_path, tiny_dir, capsys):
    url = hostile_store(tmp_path, tiny_dir)
    assert main(["info", url]) == 0
    assert_safe(capsys.readouterr().out)  # the target's name and the flag
    assert main(["show", url, "0"]) == 0
    out = capsys.readouterr().out
    assert_safe(out.splitlines()[0])  # the header line: id, source, flags
    chunk = next(p for p in Path(url, "shards").rglob("layer_003/c/0/0"))
    data = bytearray(chunk.read_bytes())
    data[50] ^= 0xFF
    chunk.write_bytes(bytes(data))
    Path(url, "shards", f"w-1-abc{FORGED}-00009").mkdir()  # debris whose name verify lists as uncommitted
    assert main(["verify", url, "--quiet"]) == 1
    out = capsys.readouterr().out
    assert "checksum mismatch" in out and "1 uncommitted shard(s)" in out
    assert_safe(out)  # the FAIL line names the sample, the note the debris


def test_show_of_an_input_file_escapes_the_row_id_and_source(tmp_path, tiny_dir, capsys):
    rows = tmp_path / "in.jsonl"
    rows.write_text(json.dumps({"id": "id" + HOSTILE, "source": "src" + HOSTILE,
                                "messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "hello there"}]}) + "\n")
    assert main(["show", str(rows), "0", "--model", str(tiny_dir)]) == 0
    assert_safe(capsys.readouterr().out.splitlines()[0])


def test_a_writer_host_never_forges_a_follow_log_line(tmp_path, caplog):
    """A dead writer's session record whose host and tag hold a newline: the follower's warning about it (and the
    lines it waits for) stay one line each, as the library logs them and through the CLI's log filter."""
    url = tmp_path / "s"
    with StoreWriter(str(url), make_manifest(), writer_tag="rank00000") as w:
        s = make_samples(1, max_len=30)[0]
        w.add("a", s["input_ids"], s["loss_mask"], s["hidden_states"])
    fs, root = storage.resolve(str(url))
    killed = sessions.new_session("rank00001", "deadbeef", host="h" + HOSTILE, pid=1, beat_s=1.0)
    killed.heartbeat_unix -= 60
    sessions.write_session(fs, root, killed)
    store = Store(str(url))
    journal = Journal.create(tmp_path / "journal", [store.url])
    leader = Leader(journal, [store], Follow(str(tmp_path / "journal"), report_s=0.0))
    with caplog.at_level(logging.INFO, logger="hsstore.loader.follow"):
        leader.poll()
    dead = [r for r in caplog.records if "no heartbeat" in r.getMessage()]
    assert dead, [r.getMessage() for r in caplog.records]
    for r in dead:
        assert_safe(r.getMessage())
        EscapingFilter().filter(r)
        assert_safe(r.msg)
    for line in leader.waiting:
        assert "\n" not in line and "\u200b" not in line


def test_the_log_filter_escapes_a_newline_in_a_value_but_keeps_the_message_lines():
    record = logging.LogRecord("x", logging.WARNING, __file__, 1, "shard %s done\nnext line", (HOSTILE,), None)
    EscapingFilter().filter(record)
    first, second = record.msg.split("\n")
    assert second == "next line"
    assert_safe(first)


def test_lookalike_ids_are_refused_at_write_and_named_by_verify(tmp_path, capsys):
    url = str(tmp_path / "s")
    samples = make_samples(3, max_len=30)

    def add(w, sid, s):
        w.add(sid, s["input_ids"], s["loss_mask"], s["hidden_states"])

    with pytest.raises(ValueError, match="only by invisible characters"):
        with StoreWriter(url, make_manifest()) as w:
            add(w, "conv-1", samples[0])
            add(w, "conv-\u200b1", samples[1])  # one writer: refused at add
    # visible characters are never folded: ids that differ in what is shown are two ids
    with StoreWriter(str(tmp_path / "t"), make_manifest()) as w:
        for sid, s in zip(["caf\u00e9", "cafe\u0301", "CAFE"], samples):
            add(w, sid, s)
    # two writers (as two runs of a job) each wrote one of a lookalike pair: verify names it
    for sid, s in (("conv-1", samples[0]), ("conv-\u200b1", samples[1])):
        with StoreWriter(str(tmp_path / "u"), make_manifest()) as w:
            add(w, sid, s)
    assert main(["verify", str(tmp_path / "u"), "--quiet"]) == 1
    out = capsys.readouterr().out
    assert "differs from 'conv-1'" in out and "conv-\\u200b1" in out and "only by invisible characters" in out


def test_extract_refuses_an_id_that_looks_like_a_stored_one(tmp_path, tiny_dir, capsys):
    """Through the real command: extract resuming into a store that holds ``demo-1`` refuses ``demo-\\u200b1``
    before any forward; the quality gate counts two such ids in one input as one id met twice."""
    convs = [{"id": "demo-1", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}]
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text(json.dumps(convs[0]) + "\n")
    out = str(tmp_path / "store")
    args = ["extract", "--model", str(tiny_dir), "--out", out, "--device", "cpu", "--quiet", "--force"]
    assert main([*args, "--input", str(first)]) == 0
    second.write_text(json.dumps({**convs[0], "id": "demo-\u200b1"}) + "\n")
    capsys.readouterr()
    assert main([*args, "--input", str(second)]) == 2
    err = capsys.readouterr().err
    assert "differs from 'demo-1'" in err and "only by invisible characters" in err, err
    # two such ids in one input: the quality gate counts them as one id met twice, and its report prints both
    # escaped (ids and sources are the input's strings)
    both = tmp_path / "both.jsonl"
    both.write_text(first.read_text() + second.read_text())
    gated = [a for a in args if a != "--force"]
    assert main([*gated, "--input", str(both), "--out", str(tmp_path / "other")]) == 1
    said = capsys.readouterr()
    said = said.out + said.err
    assert "1 sample id(s) occur more than once, e.g. 'demo-\\u200b1'" in said and "\u200b" not in said, said
    assert not (tmp_path / "other").exists()
