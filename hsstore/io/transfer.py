"""Moving bytes to and from a store: small atomic writes (``put_atomic``), many objects at once (``put_many``),
concurrent whole-object reads (``cat_many``), reads fetched again when their checksum fails (``cat_verified``) and
reads straight into the caller's memory (``cat_into``). Only ``hsstore.io.door`` (and benchmarks of it) read through
these: everything else reads a store through the door's guards."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import fsspec

from .backends import backend_for
from .backends.base import metadata_concurrency
from .listing import stamp

log = logging.getLogger(__name__)

# What no HTTP layer sees -- a body that arrived whole by its Content-Length but fails its checksum -- is
# fetched again by hsstore this many times in all, with exponential backoff, before it is called corrupt.
FETCH_ATTEMPTS = 3
FETCH_BACKOFF_S = 0.2


def put_atomic(fs: fsspec.AbstractFileSystem, path: str, data: bytes, root: str | None = None) -> str | None:
    """Write a small object so that readers see all of it or none of it; return its stamp (``stamp``), as a
    listing will show it, when the filesystem tells (None: unknown).

    Object stores give this for free (a PUT is atomic); on local disk a temporary file beside it is renamed
    over it, every folder below ``root`` (the store's) opened without following a link (the backend's
    ``put_atomic``).
    """
    entry = backend_for(fs).put_atomic(fs, path, data, root)
    return stamp(entry) if isinstance(entry, dict) else None


def put_many(fs: fsspec.AbstractFileSystem, objects: dict[str, Any], root: str | None = None) -> None:
    """Write many objects, each ``bytes`` or something with ``parts()`` (written without joining on
    local disk). Concurrent on async filesystems; parent folders are made on local disk, none below ``root``
    (the store's) followed when it is a link."""
    if objects:
        backend_for(fs).put_many(fs, objects, root)


def cat_many(fs: fsspec.AbstractFileSystem, paths: list[str], sizes: list[int],
             concurrency: int | None = None) -> dict[str, bytes | Exception]:
    """Read whole objects of ``sizes`` (each one's, from a record or a listing), concurrently on async
    filesystems; a failed read maps to its exception.

    Each is one ranged GET of its size: a store's bytes are read only as far as is expected (an object without
    a size is refused, ``backends.base.whole_sizes``), with no HEAD before the GET and no scan of s3fs's
    cached listing for the size (which grows with the listing: quadratic in the number of records).
    ``concurrency``: requests in flight (default: the metadata concurrency, ``metadata_concurrency``).
    """
    if not paths:
        return {}
    out = backend_for(fs).read_objects(fs, paths, sizes, concurrency or metadata_concurrency())
    return dict(zip(paths, out))


def cat_verified(fs: fsspec.AbstractFileSystem, paths: list[str], ok: Callable[[str, bytes], bool],
                 sizes: dict[str, int], attempts: int = FETCH_ATTEMPTS) -> dict[str, bytes | Exception]:
    """``cat_many``, then on object stores fetch again, with backoff, the objects that arrived but fail
    ``ok(path, blob)`` (a checksum or size check): bytes cut or damaged in transit look complete to the
    HTTP client. What still fails after ``attempts`` is returned as it came (the caller names it corrupt).
    Exceptions are returned as they are: the client has already retried them. ``sizes`` (path -> size the
    commit record lists): one ranged GET per object; an object of another size arrives cut or short of its
    end, which ``ok`` refuses like any damaged one."""
    out = cat_many(fs, paths, _sizes_of(paths, sizes))
    if backend_for(fs).local_paths:  # bytes at rest: fetched again, they are the same
        return out
    for attempt in range(1, attempts):
        bad = [p for p, b in out.items() if isinstance(b, (bytes, bytearray)) and not ok(p, b)]
        if not bad:
            break
        log.warning("%d object(s) failed their checksum, fetching again (attempt %d of %d): %s",
                    len(bad), attempt + 1, attempts, bad[0])
        time.sleep(FETCH_BACKOFF_S * 2 ** (attempt - 1))
        out.update(cat_many(fs, bad, _sizes_of(bad, sizes)))
    return out


def cat_into(fs: fsspec.AbstractFileSystem, targets: dict[str, list[Any]],
             check: Callable[[str], str | None] | None = None, attempts: int = FETCH_ATTEMPTS,
             concurrency: int | None = None) -> dict[str, Exception | str | None]:
    """Whole objects straight into the caller's buffers: object ``path`` fills the contiguous writable buffers
    ``targets[path]`` in turn (as ``preadv`` does) with one ranged GET of their total size.

    Why: a body read as one bytes object is pieced together in fresh memory, twice (the HTTP parser's pieces,
    then their join), and a process that faults in every byte it receives spends more CPU on that than on the
    read; streamed into buffers the loader recycles, the same reads cost a fraction (docs/PERFORMANCE.md,
    "Reading from S3").
    The backend's ``fill`` moves them: on S3 the body's pieces are copied as they arrive; the protocol's default
    fetches each object whole as bytes and copies it.

    ``check(path)`` (a checksum of the filled buffers) returns None or what is wrong: such objects are fetched
    again, with backoff, up to ``attempts`` fetches in all, as ``cat_verified`` does. Returns path -> None
    (filled, and passed ``check``), the check's message for an object that filled its buffers but failed it
    or arrived short (data: the caller names it corrupt), or the exception of a read that failed after the
    client's retries (the path to the store). A body cut mid-way is fetched again like any retryable error."""
    views = {p: [memoryview(b).cast("B") for b in bufs] for p, bufs in targets.items()}
    out: dict[str, Exception | str | None] = {}
    pending = list(views)
    for attempt in range(attempts):
        if attempt:
            log.warning("%d object(s) arrived short or failed their checksum, fetching again (attempt %d of %d): "
                        "%s", len(pending), attempt + 1, attempts, pending[0])
            time.sleep(FETCH_BACKOFF_S * 2 ** (attempt - 1))
        got = backend_for(fs).fill(fs, {p: views[p] for p in pending}, concurrency or metadata_concurrency())
        again = []
        for p in pending:
            n, want = got[p], sum(len(v) for v in views[p])
            if isinstance(n, Exception):
                out[p] = n
            elif n != want:
                out[p] = (f"object ended early ({n:,} of {want:,} bytes)" if n < want
                          else f"object holds more than the {want:,} bytes expected")
                again.append(p)
            else:
                out[p] = check(p) if check is not None else None
                if out[p] is not None:
                    again.append(p)
        pending = again
        if not pending or backend_for(fs).local_paths:
            break
    return out


def _sizes_of(paths: list[str], sizes: dict[str, int]) -> list[int | None]:
    return [sizes.get(p) for p in paths]


def fetch_failure(blob: Any) -> str | None:
    """None when ``blob`` is bytes or a missing object; else a one-line reason the read failed."""
    if isinstance(blob, Exception) and not isinstance(blob, FileNotFoundError):
        return f"{type(blob).__name__}: {blob}"
    return None
