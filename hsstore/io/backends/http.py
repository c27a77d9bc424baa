"""A store served over HTTP(S), read only: every GET and index page ``receive``'s (the bytes asked for, a
deadline, no redirect, no decoding); an index page gives no sizes, so an object's size is its server's ``HEAD``
(``size``) or the read is capped."""

from __future__ import annotations

import copy
from typing import Any

from .. import receive
from .base import Bounded, ReadOnly


class HTTPBackend(Bounded, ReadOnly):
    name = "http"
    protocols = ("http", "https")
    lists_sizes = False

    @staticmethod
    async def fetch(fs, path: str, start: int, end: int, size: int | None = None) -> bytes:
        return await receive.http_get(fs, path, start, end, size)

    def options(self, options: dict[str, Any]) -> dict[str, Any]:
        """No redirects followed, no bodies decoded and a deadline on the requests fsspec itself makes (``HEAD``:
        ``receive.request_s()``); hsstore's GETs and listings are ``receive``'s, bounded as they are made."""
        import aiohttp

        out = copy.copy(options)
        out.setdefault("allow_redirects", False)
        client = dict(out.get("client_kwargs") or {})
        client.setdefault("auto_decompress", False)
        client.setdefault("timeout", aiohttp.ClientTimeout(total=receive.request_s()))
        out["client_kwargs"] = client
        return out

    def size(self, fs, path: str) -> int | None:
        """The length a bounded ``HEAD`` declares (``receive.object_size``)."""
        return receive.object_size(fs, path)

    def list_detail(self, fs, path: str, splits: list[str] | None = None, concurrency: int = 1
                    ) -> dict[str, dict[str, Any]]:
        """The HTML index page, bounded (sizes unknown: each object's read is bounded instead)."""
        from fsspec.asyn import sync

        try:
            names = sync(fs.loop, receive.http_list, fs, path)
        except FileNotFoundError:
            return {}
        base = path.rstrip("/")
        return {n: {"name": f"{base}/{n}", "size": None, "type": "file"} for n in names if not n.endswith("/")}

    def list_names(self, fs, path: str) -> list[str]:
        from fsspec.asyn import sync

        try:
            return [n.rstrip("/") for n in sync(fs.loop, receive.http_list, fs, path)]
        except FileNotFoundError:
            return []
