"""What a person reads in a terminal (issue #52, item 8): control characters and bidirectional overrides from a
store are escaped, any other text -- no-break and ideographic spaces, zero-width joiners inside emoji, letters of
every script -- is shown as it is, through ``hsstore show`` and the log."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from hsstore.io import storage
from hsstore.app.cli import main
from hsstore.format.assets import write_assets
from hsstore.terminal import EscapingFilter, escape, shown

from conftest import make_manifest

READABLE = "a\xa0b \u4e2d\u3000\u6587 \U0001F469\u200d\U0001F4BB caf\u00e9"  # NBSP, ideographic space, ZWJ emoji
HOSTILE = {"\x1b[2J": "\\x1b[2J", "\u202e": "\\u202e", "\u2066": "\\u2066", "\x9b": "\\x9b", "\x07": "\\x07",
           "\u2028": "\\u2028", "\r": "\\r"}


def test_escape_keeps_what_people_read_and_escapes_what_drives_the_terminal():
    text = READABLE + "".join(HOSTILE)
    for out in (escape(text), escape(text, keep="\n\t"), shown(text)):
        assert READABLE in out, out
        assert all(raw not in out and esc in out for raw, esc in HOSTILE.items()), ascii(out)
    assert escape("a\nb\tc", keep="\n\t") == "a\nb\tc" and escape("a\nb") == "a\\nb"
    assert shown("it's") == repr("it's") and shown("a\\b") == repr("a\\b") and shown("x\x00") == repr("x\x00")
    record = logging.LogRecord("x", logging.WARNING, __file__, 1, "id %s", (text,), None)
    EscapingFilter().filter(record)
    assert READABLE in record.msg and "\u202e" not in record.msg and "\x1b" not in record.msg


def _store_with_text(tmp_path: Path, tiny_dir, text: str) -> str:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"])
    assert tok.decode(ids.tolist()) == text  # the tokenizer round-trips it: what show prints is the text itself
    url = str(tmp_path / "s")
    from hsstore.store.writer import StoreWriter

    with StoreWriter(url, make_manifest()) as w:
        w.add(f"id{READABLE}", ids, torch.ones(len(ids), dtype=torch.bool),
              torch.randn(len(ids), 3, 48).to(torch.bfloat16), source=f"src\u202e{READABLE}")
    fs, root = storage.resolve(url)
    write_assets(fs, root, {f"tokenizer/{p.name}": p.read_bytes() for p in Path(tiny_dir).iterdir()
                            if p.name.startswith(("tokenizer", "special_tokens", "chat_template"))})
    return url


def test_show_prints_a_no_break_space_and_emoji_as_they_are(tmp_path, tiny_dir, capsys):
    url = _store_with_text(tmp_path, tiny_dir, READABLE + " x" + "".join(HOSTILE) + "y")
    assert main(["show", url, "0"]) == 0
    out = capsys.readouterr().out
    assert "\\xa0" not in out and "\\u3000" not in out and "\\u200d" not in out, out
    assert out.count(READABLE) >= 3, out  # the text, the id and the source in the header line
    assert all(raw not in out and esc in out for raw, esc in HOSTILE.items()), ascii(out)
