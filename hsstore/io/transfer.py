"""Moving bytes to and from a store: small atomic writes (``put_atomic``), many objects at once (``put_many``),
concurrent whole-object reads (``cat_many``), reads fetched again when their checksum fails (``cat_verified``) and
reads straight into the caller's memory (``cat_into``). Only ``hsstore.io.door`` (and benchmarks of it) read through
these: everything else reads a store through the door's guards."""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import fsspec
from fsspec.asyn import AsyncFileSystem

from . import receive, sinks
from .listing import stamp
from .storage import is_local, metadata_concurrency

log = logging.getLogger(__name__)

# What no HTTP layer sees -- a body that arrived whole by its Content-Length but fails its checksum -- is
# fetched again by hsstore this many times in all, with exponential backoff, before it is called corrupt.
FETCH_ATTEMPTS = 3
FETCH_BACKOFF_S = 0.2


def put_atomic(fs: fsspec.AbstractFileSystem, path: str, data: bytes, root: str | None = None) -> str | None:
    """Write a small object so that readers see all of it or none of it; return its stamp (``stamp``), as a
    listing will show it, when the filesystem tells (None: unknown).

    Object stores give this for free (a PUT is atomic); on local disk a temporary file beside it is renamed
    over it, every folder below ``root`` (the store's) opened without following a link (``sinks``).
    """
    if is_local(fs):
        base, rel = _beneath(path, root)
        return stamp({"mtime": sinks.write_atomic(base, rel, data, what=f"writing {path}").st_mtime})
    response = fs.pipe_file(path, data)
    return stamp(response) if isinstance(response, dict) else None


def _beneath(path: str, root: str | None) -> tuple[str, str]:
    """(folder, relative name) of a local ``path``: below ``root`` when it is under it (its folders are then
    checked for links), else below the path's own folder (the name itself is still never followed)."""
    if root and path.startswith(root.rstrip("/") + "/"):
        return root, path[len(root.rstrip("/")) + 1:]
    return os.path.dirname(path) or ".", os.path.basename(path)


def put_many(fs: fsspec.AbstractFileSystem, objects: dict[str, Any], root: str | None = None) -> None:
    """Write many objects, each ``bytes`` or something with ``parts()`` (written without joining on
    local disk). Concurrent on async filesystems; parent folders are made on local disk, none below ``root``
    (the store's) followed when it is a link."""
    if not objects:
        return
    if is_local(fs):
        folders = {(base, os.path.dirname(rel)): p for p in objects for base, rel in [_beneath(p, root)]}
        for (base, folder), p in folders.items():
            os.close(sinks.open_folder(base, folder, what=f"writing {p}"))
        # several files in flight: a disk (NVMe above all) needs queue depth, and each fsync waits
        list(_local_pool().map(lambda item: _write_local(*_beneath(item[0], root), item[1]), objects.items()))
    else:
        fs.pipe({p: d.tobytes() if hasattr(d, "tobytes") and not isinstance(d, bytes) else d
                 for p, d in objects.items()})


_POOL: ThreadPoolExecutor | None = None
_POOL_PID = -1


def _local_pool() -> ThreadPoolExecutor:
    global _POOL, _POOL_PID
    if _POOL is None or _POOL_PID != os.getpid():  # a forked child must not use the parent's threads
        _POOL, _POOL_PID = ThreadPoolExecutor(max_workers=4, thread_name_prefix="hsstore-io"), os.getpid()
    return _POOL


def _write_local(base: str, rel: str, data: Any) -> None:
    # durable before the commit record that points at it: a power loss must not leave a committed
    # shard whose chunks never reached the disk
    sinks.write_file(base, rel, list(data.parts()) if hasattr(data, "parts") else data, what=f"writing {rel}")


def cat_many(fs: fsspec.AbstractFileSystem, paths: list[str], sizes: list[int] | None = None,
             concurrency: int | None = None) -> dict[str, bytes | Exception]:
    """Read whole objects, concurrently on async filesystems; a failed read maps to its exception.

    ``cat_ranges`` rather than ``cat``: fsspec's ``cat`` of a list first expands the paths, which on S3
    costs one HEAD request per object before its GET. ``sizes`` (known from a listing) turn each read into
    one ranged GET: without them s3fs looks each size up first, in a scan of its cached listing that grows
    with the listing (quadratic in the number of records). ``concurrency``: requests in flight (default:
    the metadata concurrency, ``metadata_concurrency``).
    """
    if not paths:
        return {}
    n_in_flight = concurrency or metadata_concurrency()
    if sizes is not None and (receive.is_http(fs) or receive.is_s3(fs)):  # every answer bounded by its size
        out = receive.get_ranges(fs, paths, [0] * len(paths), list(sizes), list(sizes), n_in_flight)
        return dict(zip(paths, out))
    starts: list = [None] * len(paths)
    ends: list = [None] * len(paths)
    if sizes is not None and not is_local(fs):
        starts = [0 if n else None for n in sizes]
        ends = [n if n else None for n in sizes]  # an empty object takes no Range
    kw = {"batch_size": n_in_flight} if isinstance(fs, AsyncFileSystem) else {}
    out = fs.cat_ranges(paths, starts, ends, on_error="return", **kw)
    return dict(zip(paths, out))


def cat_verified(fs: fsspec.AbstractFileSystem, paths: list[str], ok: Callable[[str, bytes], bool],
                 attempts: int = FETCH_ATTEMPTS, sizes: dict[str, int] | None = None) -> dict[str, bytes | Exception]:
    """``cat_many``, then on object stores fetch again, with backoff, the objects that arrived but fail
    ``ok(path, blob)`` (a checksum or size check): bytes cut or damaged in transit look complete to the
    HTTP client. What still fails after ``attempts`` is returned as it came (the caller names it corrupt).
    Exceptions are returned as they are: the client has already retried them. ``sizes`` (path -> size the
    commit record lists): one ranged GET per object instead of a HEAD and a GET; an object of another size
    then arrives cut or short of its end, which ``ok`` refuses like any damaged one."""
    out = cat_many(fs, paths, _sizes_of(paths, sizes))
    if is_local(fs):
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


def streams(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether ``cat_into`` streams bodies into the buffers (s3fs: its client's body pieces are copied as they
    arrive) rather than fetching each whole as bytes and copying it (every other filesystem)."""
    return hasattr(fs, "_call_s3")


def cat_into(fs: fsspec.AbstractFileSystem, targets: dict[str, list[Any]],
             check: Callable[[str], str | None] | None = None, attempts: int = FETCH_ATTEMPTS,
             concurrency: int | None = None) -> dict[str, Exception | str | None]:
    """Whole objects straight into the caller's buffers: object ``path`` fills the contiguous writable buffers
    ``targets[path]`` in turn (as ``preadv`` does) with one ranged GET of their total size.

    Why: a body read as one bytes object is pieced together in fresh memory, twice (the HTTP parser's pieces,
    then their join), and a process that faults in every byte it receives spends more CPU on that than on the
    read; streamed into buffers the loader recycles, the same reads cost a fraction (docs/PERFORMANCE.md,
    "Reading from S3").
    On s3fs the body's pieces are copied as they arrive; other filesystems fall back to ``cat_many`` + copy.

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
        got = _fill(fs, {p: views[p] for p in pending}, concurrency or metadata_concurrency())
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
        if not pending or is_local(fs):
            break
    return out


def _fill(fs, views: dict[str, list[memoryview]], concurrency: int) -> dict[str, int | Exception]:
    """path -> bytes written into its views (or the exception that stopped the read)."""
    if not streams(fs):
        sizes = [sum(len(v) for v in vs) for vs in views.values()]
        blobs = cat_many(fs, list(views), sizes, concurrency)
        return {p: (b if isinstance(b, Exception) else receive.scatter(b, views[p])) for p, b in blobs.items()}
    from fsspec.asyn import sync

    async def run() -> dict[str, int | Exception]:
        import asyncio

        gate = asyncio.Semaphore(concurrency)

        async def one(path: str) -> int | Exception:
            async with gate:
                try:
                    return await receive.s3_into(fs, path, views[path])
                except Exception as e:  # returned, as cat_many returns a failed read
                    return e

        paths = list(views)
        return dict(zip(paths, await asyncio.gather(*(one(p) for p in paths))))

    return sync(fs.loop, run)


def _sizes_of(paths: list[str], sizes: dict[str, int] | None) -> list[int] | None:
    if not sizes or any(p not in sizes for p in paths):
        return None
    return [int(sizes[p]) for p in paths]


def fetch_failure(blob: Any) -> str | None:
    """None when ``blob`` is bytes or a missing object; else a one-line reason the read failed."""
    if isinstance(blob, Exception) and not isinstance(blob, FileNotFoundError):
        return f"{type(blob).__name__}: {blob}"
    return None
