"""Storage backends (``base``: the protocol) and their registry: where a store's objects live -- local disk
(``local``), S3 (``s3``), an HTTP server (``http``) -- told apart once, here, by the filesystem or the URL; every
other module asks the backend what it can do (``backend_for(fs).local_paths``, ``.writable``, ``.get_ranges``
...), never which kind it is (``tests/test_architecture.py`` holds it). A filesystem no backend claims is served
by ``Backend`` (fsspec's own calls). Adding a backend is a module with one subclass and one ``register`` call
(docs/ARCHITECTURE.md, "Storage backends")."""

from __future__ import annotations

from .base import Backend
from .http import HTTPBackend
from .local import LocalBackend
from .s3 import S3Backend

BACKENDS: list[Backend] = [LocalBackend(), S3Backend(), HTTPBackend()]  # asked in turn; the first that matches
FALLBACK = Backend()  # any other fsspec filesystem
_BY_TYPE: dict[tuple, Backend] = {}  # a filesystem class's backend, chosen once


def register(backend: Backend) -> None:
    """Add ``backend`` ahead of those registered before it (an outside backend may claim what a shipped one
    would)."""
    BACKENDS.insert(0, backend)
    _BY_TYPE.clear()


def unregister(backend: Backend) -> None:
    """Remove ``backend`` (one ``register`` added) from the registry."""
    BACKENDS.remove(backend)
    _BY_TYPE.clear()


def backend_for(fs) -> Backend:
    """The backend of filesystem ``fs``, chosen once per filesystem class and protocol."""
    key = (type(fs), fs.protocol if isinstance(fs.protocol, str) else tuple(fs.protocol))
    got = _BY_TYPE.get(key)
    if got is None:
        got = _BY_TYPE[key] = next((b for b in BACKENDS if b.matches(fs)), FALLBACK)
    return got


def backend_for_url(url: str) -> Backend:
    """The backend a store URL is served by, from its scheme alone (nothing is opened)."""
    return next((b for b in BACKENDS if b.matches_url(url)), FALLBACK)
