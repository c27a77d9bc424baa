"""Strings from a store made safe to print: a forged sample id must not write a fake ``OK`` line, set the window
title, clear the screen or reorder what a person reads.

Every store-controlled string (ids, flags, sources, names, URLs, model names) printed to a terminal or a log
goes through ``escape`` (or ``shown``, which quotes). What drives a terminal or hides text is escaped as ``repr``
writes it: control characters (C0 and C1, newlines and tabs unless kept), line and paragraph separators, lone
surrogates, and the bidirectional controls that make text display in another order than it is stored (the
"Trojan source" overrides and isolates), and what shows nothing itself (``invisible``: format characters such as
the zero-width space, word joiner and soft hyphen, the tag block, private-use and unassigned code points), which
could otherwise hide a message in an id or make two different ids look alike. Everything else a person reads is
shown as it is: non-ASCII letters, no-break and ideographic spaces, a zero-width joiner or non-joiner between two
visible non-ASCII characters (inside an emoji sequence, a Persian or Indic word: it shapes what is shown). JSON
output needs nothing (``json.dumps`` escapes control characters) and HTML is escaped by ``html.escape``.

Two sample ids a person cannot tell apart are one id to a person: ``visible_key`` is an id with its invisible
characters removed (visible characters are never folded), and writers refuse a new id whose key is an existing
id's (``lookalike``); ``verify`` names such a pair.
"""

from __future__ import annotations

import logging
import unicodedata
from typing import Any

# U+061C arabic letter mark, U+200E/F marks, U+202A-E embeddings and overrides, U+2066-9 isolates
BIDI_CONTROLS = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")
_ESCAPED_CATEGORIES = frozenset({"Cc", "Cs", "Zl", "Zp"})
# format characters, private use, unassigned: nothing of them is shown (the tag block U+E0000-E007F is Cf or Cn)
_INVISIBLE_CATEGORIES = frozenset({"Cf", "Co", "Cn"})
TAGS = range(0xE0000, 0xE0080)
JOINERS = frozenset("\u200c\u200d")  # zero-width non-joiner and joiner


def invisible(c: str) -> bool:
    """Whether character ``c`` shows nothing itself: a format character, a tag, a private-use or unassigned code
    point."""
    return unicodedata.category(c) in _INVISIBLE_CATEGORIES or ord(c) in TAGS


def escaped(c: str) -> bool:
    """Whether character ``c`` is written escaped: a control, a separator of lines, a surrogate, a bidi control or
    an invisible character (a joiner between two visible non-ASCII characters excepted: ``_hidden``)."""
    return c in BIDI_CONTROLS or unicodedata.category(c) in _ESCAPED_CATEGORIES or invisible(c)


def _hidden(text: str, i: int) -> bool:
    """Whether ``text[i]`` is written escaped where it stands: ``escaped``, but a joiner whose two neighbours are
    visible non-ASCII characters is part of what they show."""
    c = text[i]
    if c in JOINERS and 0 < i < len(text) - 1:
        return not all(ord(n) > 127 and not escaped(n) for n in (text[i - 1], text[i + 1]))
    return escaped(c)


def visible_key(text: str) -> str:
    """``text`` as a person can tell it from another: its invisible characters removed, nothing else changed."""
    return text if text.isprintable() else "".join(c for c in text if not invisible(c))


def lookalike(ids, known) -> tuple[str, str] | None:
    """The first ``(id, other)`` of ``ids`` (in order) against ``known`` and the ids before it, where the two differ
    but only by invisible characters (same ``visible_key``); None when every id is told apart from the rest."""
    seen: dict[str, str] = {}
    for other in known:
        seen.setdefault(visible_key(other), other)
    for sid in ids:
        other = seen.setdefault(visible_key(sid), sid)
        if other != sid:
            return sid, other
    return None


def lookalike_refusal(sample_id: str, other: str, where: str) -> str:
    """One line refusing ``sample_id`` beside ``other`` (``where``: where that one is) by ``lookalike``."""
    return (f"sample id {shown(sample_id)} differs from {shown(other)} ({where}) only by invisible characters: a "
            "person cannot tell the two apart (sample ids must differ in what is shown)")


def _repr(c: str) -> str:
    return repr(c)[1:-1]  # every escaped character is one repr escapes: \x1b, \u202e, \ud800


def escape(value: Any, keep: str = "") -> str:
    """``value`` as text with the characters ``escaped`` picks (newlines and tabs included, but those in ``keep``)
    written as ``repr`` writes them, without quotes: ``'a\\nb'`` -> ``a\\nb``; any other character as it is.
    ``keep="\\n\\t"`` for decoded text meant to be read as lines (``hsstore show``): escape sequences still appear
    as text."""
    text = value if isinstance(value, str) else str(value)
    if text.isprintable():  # the common case: nothing to look at one by one
        return text
    return "".join(_repr(c) if c not in keep and _hidden(text, i) else c for i, c in enumerate(text))


def shown(value: Any) -> str:
    """``value`` quoted as ``repr`` quotes a string (backslashes and the quote escaped), with the characters
    ``escaped`` picks escaped and the rest as it is; anything but a string as text (``escape``)."""
    if not isinstance(value, str):
        return escape(value)
    quote = '"' if "'" in value and '"' not in value else "'"
    body = "".join("\\\\" if c == "\\" else "\\" + c if c == quote else _repr(c) if _hidden(value, i) else c
                   for i, c in enumerate(value))
    return quote + body + quote


class EscapingFilter(logging.Filter):
    """Escapes the non-printable characters of every record passing a handler, so a store string logged unquoted
    cannot drive the terminal: the values formatted into the message wholly (a newline in one cannot start a
    forged line), the message's own text with its newlines and tabs kept (a log message may span lines)."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            if isinstance(record.args, tuple):
                record.args = tuple(escape(a) if isinstance(a, (str, BaseException)) else a for a in record.args)
            message = record.getMessage()
        except Exception:  # a malformed record: leave it to the handler
            return True
        record.msg, record.args = escape(message, keep="\n\t"), None
        return True
