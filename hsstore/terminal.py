"""Strings from a store made safe to print: a forged sample id must not write a fake ``OK`` line, set the window
title, clear the screen or reorder what a person reads.

Every store-controlled string (ids, flags, sources, names, URLs, model names) printed to a terminal or a log
goes through ``escape`` (or ``shown``, which quotes). What drives a terminal or hides text is escaped as ``repr``
writes it: control characters (C0 and C1, newlines and tabs unless kept), line and paragraph separators, lone
surrogates, and the bidirectional controls that make text display in another order than it is stored (the
"Trojan source" overrides and isolates). Everything else a person reads is shown as it is: non-ASCII letters,
no-break and ideographic spaces, zero-width joiners inside emoji. JSON output needs nothing (``json.dumps``
escapes control characters) and HTML is escaped by ``html.escape``.
"""

from __future__ import annotations

import logging
import unicodedata
from typing import Any

# U+061C arabic letter mark, U+200E/F marks, U+202A-E embeddings and overrides, U+2066-9 isolates
BIDI_CONTROLS = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")
_ESCAPED_CATEGORIES = frozenset({"Cc", "Cs", "Zl", "Zp"})


def escaped(c: str) -> bool:
    """Whether character ``c`` is written escaped: a control, a separator of lines, a surrogate or a bidi control."""
    return c in BIDI_CONTROLS or unicodedata.category(c) in _ESCAPED_CATEGORIES


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
    return "".join(_repr(c) if c not in keep and escaped(c) else c for c in text)


def shown(value: Any) -> str:
    """``value`` quoted as ``repr`` quotes a string (backslashes and the quote escaped), with the characters
    ``escaped`` picks escaped and the rest as it is; anything but a string as text (``escape``)."""
    if not isinstance(value, str):
        return escape(value)
    quote = '"' if "'" in value and '"' not in value else "'"
    body = "".join("\\\\" if c == "\\" else "\\" + c if c == quote else _repr(c) if escaped(c) else c
                   for c in value)
    return quote + body + quote


class EscapingFilter(logging.Filter):
    """Escapes the non-printable characters of every record passing a handler (its newlines and tabs kept: a log
    message may span lines), so a store string logged unquoted cannot drive the terminal."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record: leave it to the handler
            return True
        record.msg, record.args = escape(message, keep="\n\t"), None
        return True
