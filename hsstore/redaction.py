"""Credentials never leave the process in text: not in error messages, logs or anything written.

Storage options with secret-looking keys (``key``, ``secret``, ``token``, ...), the AWS secret environment
variables and the ``user:password@`` part of URLs are registered when seen; :func:`scrub` replaces them in
any text. ``StoreError`` scrubs its message, and the CLI puts :class:`RedactingFilter` on its log handlers,
so third-party debug logs (botocore prints endpoint URLs and signed headers) are scrubbed too.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

from .locks import ProcessLock

SECRET_OPTION_WORDS = ("secret", "token", "password", "key", "credential", "session")
SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")  # the key id is not a secret
MASK = "***"
_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s:]+:[^/@\s]+@")
_ANY_USERINFO = re.compile(r"^(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s]*@")
_QUERY_SECRET = re.compile(r"(?P<key>[?&][^=&#\s]+)=(?P<value>[^&#\s]*)")
_known: set[str] = set()
_lock = ProcessLock()


def is_secret_key(key: str) -> bool:
    return any(w in key.lower() for w in SECRET_OPTION_WORDS)


def register(options: dict[str, Any] | None) -> None:
    """Remember the secret values of storage options (nested too) and of the environment."""
    values = [os.environ.get(k, "") for k in SECRET_ENV]

    def walk(d: dict[str, Any]) -> None:
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v)
            elif isinstance(v, str) and is_secret_key(str(k)):
                values.append(v)
            elif isinstance(v, str):  # an endpoint URL with user:password
                for m in _USERINFO.finditer(v):
                    values.append(m.group(0)[len(m.group("scheme")):-1])

    walk(options or {})
    with _lock:
        _known.update(v for v in values if len(v) >= 4)  # short values would mask ordinary words


def scrub(text: str) -> str:
    """``text`` with registered secrets and URL passwords replaced by ``***``."""
    if not text:
        return text
    text = _USERINFO.sub(lambda m: f"{m.group('scheme')}{MASK}@", text)
    with _lock:
        known = sorted(_known, key=len, reverse=True)
    for v in known:
        if v in text:
            text = text.replace(v, MASK)
    return text


def recordable_url(url: str) -> str:
    """The form of a store URL that may be written down (manifests, records, sidecars, run configs) or printed:
    its user info (``user:password@``, or a bare token before ``@``) dropped, and the values of secret-looking
    query parameters masked. Credentials belong in storage options (``-S key=... -S secret=...``) or the
    environment, which are never recorded; a URL so stripped still names the same objects."""
    if not isinstance(url, str):
        return url
    url = _ANY_USERINFO.sub(lambda m: m.group("scheme"), url)

    def mask(m: re.Match) -> str:
        key = m.group("key")[1:]
        secret = is_secret_key(key) or "signature" in key.lower() or key.lower() == "sig"  # presigned, SAS
        return f"{m.group('key')}={MASK}" if secret else m.group(0)

    return _QUERY_SECRET.sub(mask, url) if "://" in url and "?" in url else url


def redact(options: dict[str, Any]) -> dict[str, Any]:
    """Options with secret-looking values replaced, for logs and cache keys."""
    out: dict[str, Any] = {}
    for k, v in options.items():
        if isinstance(v, dict):
            out[k] = redact(v)
        elif is_secret_key(k):
            out[k] = MASK
        else:
            out[k] = scrub(v) if isinstance(v, str) else v
    return out


class RedactingFilter(logging.Filter):
    """Scrubs every record passing a handler (message and exception text)."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record: leave it to the handler
            return True
        record.msg, record.args = scrub(message), None
        if record.exc_info:
            record.exc_text = scrub(logging.Formatter().formatException(record.exc_info))
            record.exc_info = None
        return True
