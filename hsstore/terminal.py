"""Strings from a store made safe to print: a forged sample id must not write a fake ``OK`` line, set the window
title or clear the screen.

Every store-controlled string (ids, flags, sources, names, URLs, model names) printed to a terminal or a log
goes through ``escape`` (or ``shown``, which quotes): newlines, escape sequences and every other non-printable
character appear as ``repr`` writes them. JSON output needs nothing (``json.dumps`` escapes control
characters) and HTML is escaped by ``html.escape``.
"""

from __future__ import annotations

import logging
from typing import Any


def escape(value: Any, keep: str = "") -> str:
    """``value`` as text with its non-printable characters (newlines and tabs included, but those in ``keep``)
    written as ``repr`` writes them, without quotes: ``'a\\nb'`` -> ``a\\nb``. ``keep="\\n\\t"`` for
    decoded text meant to be read as lines (``hsstore show``): escape sequences still appear as text."""
    text = value if isinstance(value, str) else str(value)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c in keep else repr(c)[1:-1] for c in text)


def shown(value: Any) -> str:
    """``value`` quoted as ``repr`` does (strings) or as text (anything else), always printable."""
    return repr(value) if isinstance(value, str) else escape(value)


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
