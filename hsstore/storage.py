"""Where a store lives: fsspec URLs (local paths, ``s3://bucket/prefix``, anything fsspec knows).

One job: turn a URL plus storage options into a filesystem and a root path, and do the few
filesystem operations the format needs (atomic small-object writes, listing, concurrent reads).
Credentials given as storage options never appear in messages (see ``redaction``).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import threading
import time
import uuid
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import fsspec
from fsspec.asyn import AsyncFileSystem
from fsspec.core import url_to_fs

from .errors import StoreError
from . import redaction
from .redaction import redact, register  # noqa: F401  (redact: storage.redact is the public name)

log = logging.getLogger(__name__)


# Retry policy on object stores (see docs/ARCHITECTURE.md, "Faults and retries"). botocore retries every
# request (connection errors, 500/502/503/504, SlowDown and other throttling) with capped exponential
# backoff and full jitter; s3fs wraps each call in its own retries (connection/payload errors, SlowDown).
# Options the user gives (``config_kwargs.retries``) win.
S3_RETRIES = {"mode": "standard", "max_attempts": 6}
# What no HTTP layer sees -- a body that arrived whole by its Content-Length but fails its checksum -- is
# fetched again by hsstore this many times in all, with exponential backoff, before it is called corrupt.
FETCH_ATTEMPTS = 3
FETCH_BACKOFF_S = 0.2
# Small objects (commit records, index segments) read at once: latency, not bandwidth, is their cost, so many
# requests in flight. ``HSSTORE_METADATA_CONCURRENCY`` overrides it; s3fs's connection pool is raised to match
# (botocore's default of 10 connections capped a 1,000-record open at ~6 requests in flight).
METADATA_CONCURRENCY = 64
METADATA_CONCURRENCY_ENV = "HSSTORE_METADATA_CONCURRENCY"


MANIFEST_FILE = "manifest.json"  # a folder is a store when this file is in it (docs/FORMAT.md)

def metadata_concurrency() -> int:
    """Requests in flight for small-object reads (``HSSTORE_METADATA_CONCURRENCY``, default 64)."""
    raw = os.environ.get(METADATA_CONCURRENCY_ENV, "")
    try:
        n = int(raw) if raw.strip() else METADATA_CONCURRENCY
    except ValueError:
        raise StoreError(f"{METADATA_CONCURRENCY_ENV}={raw!r}: expected a positive integer") from None
    if n < 1:
        raise StoreError(f"{METADATA_CONCURRENCY_ENV}={raw!r}: expected a positive integer")
    return n


def parse_storage_options(pairs: list[str] | None) -> dict[str, Any]:
    """Parse repeated ``key=value`` CLI options; values may be JSON (true, 3, {"a": 1}) or plain strings.

    Dotted keys nest: ``client_kwargs.region_name=us-east-1`` -> {"client_kwargs": {"region_name": ...}}.
    """
    options: dict[str, Any] = {}
    for pair in pairs or []:
        if "=" not in pair:
            raise StoreError(f"--storage-option {pair.split('=')[0]!r}: expected key=value")
        key, raw = pair.split("=", 1)
        try:
            value: Any = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        target = options
        *parents, leaf = key.strip().split(".")
        for p in parents:
            target = target.setdefault(p, {})
        target[leaf] = value
    return options


def resolve(url: str, storage_options: dict[str, Any] | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """(filesystem, root path without trailing slash) for a store URL."""
    register({**(storage_options or {}), "url": url})  # its secrets are masked in every message from now on
    options = dict(storage_options or {})
    interactive = options.pop(INTERACTIVE, False)
    try:
        fs, root = url_to_fs(url, **with_retry_defaults(url, options))
    except Exception as e:  # bad protocol, bad options: name the URL, never the options
        raise StoreError(f"cannot open store URL {url!r}: {type(e).__name__}: {e}") from None
    if interactive and hasattr(fs, "retries"):  # s3fs's own rounds around botocore's attempts
        fs.retries = S3FS_INTERACTIVE_RETRIES
    return fs, root.rstrip("/")


def store_exists(fs: fsspec.AbstractFileSystem, root: str, url: str) -> bool:
    """Whether a store is at ``root``: its manifest is there. A filesystem that cannot answer, or a bucket
    that does not exist, raises ``StoreError`` (saying what to do) instead of answering no: a destination that
    cannot be reached is not an empty one, and a job should learn so before its expensive part."""
    try:
        if fs.exists(join(root, MANIFEST_FILE)):
            return True
    except Exception as e:
        raise StoreError(explain(e, url, "read", fs, root)) from None
    if missing_bucket(fs, root):
        raise StoreError(explain(FileNotFoundError(root), url, "read", fs, root))
    return False


def with_retry_defaults(url: str, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` plus hsstore's botocore retry policy and a connection pool as large as the metadata
    concurrency for ``s3://`` URLs, unless the user set them."""
    if not url.startswith(("s3://", "s3a://")):
        return options
    out = copy.deepcopy(options)
    config = out.setdefault("config_kwargs", {})
    if isinstance(config, dict):
        config.setdefault("retries", dict(S3_RETRIES))
        config.setdefault("max_pool_connections", max(10, metadata_concurrency()))
    return out


# Interactive commands (info, index, report, show) answer in seconds or fail saying why: a short connect
# timeout, botocore's one retry and no second round from s3fs (S3_RETRIES and s3fs's 5 rounds are for jobs
# that read or write for hours: a closed endpoint took 29 s to be reported, an unreachable one 45-59 s).
S3_INTERACTIVE = {"connect_timeout": 3, "read_timeout": 15, "retries": {"mode": "standard", "total_max_attempts": 2}}
S3FS_INTERACTIVE_RETRIES = 1
INTERACTIVE = "hsstore_interactive"  # the option that asks ``resolve`` for s3fs's interactive retries (not passed on)


def interactive_options(url: str, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` plus ``S3_INTERACTIVE`` (botocore's timeouts and retries, as ``config_kwargs``, each only where
    the user did not set it) for ``s3://`` URLs, and the mark that gives the filesystem s3fs's interactive
    ``retries`` (an attribute of the filesystem, not an option s3fs takes)."""
    if not url.startswith(("s3://", "s3a://")):
        return options
    out = copy.deepcopy(options)
    config = out.setdefault("config_kwargs", {})
    if isinstance(config, dict):
        for key, value in S3_INTERACTIVE.items():
            config.setdefault(key, copy.deepcopy(value))
    out[INTERACTIVE] = True
    return out


def join(*parts: str) -> str:
    return "/".join(p.strip("/") if i else p.rstrip("/") for i, p in enumerate(parts) if p != "")


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol in ("file", "local")


def missing_path(fs, root: str) -> str | None:
    """What is missing of a store path that is not there (a mistyped path is told apart from a folder that is
    not a store): locally the nearest folder above it that exists; on an object store, that nothing is under
    the prefix. None when the path exists (or the filesystem cannot tell)."""
    try:
        if is_local(fs):
            if os.path.exists(root):
                return None
            above = os.path.dirname(os.path.abspath(root))
            while not os.path.isdir(above):
                above = os.path.dirname(above)
            return f"no such file or folder (the nearest folder that exists is {above})"
        return None if fs.exists(root) else "no object under that prefix"
    except Exception:
        return None


WAIT_NOTICE_S = 2.0  # a first request to an object store unanswered this long: say what is awaited


def endpoint_of(fs) -> str:
    """The endpoint an object-store filesystem talks to, as a person would check it."""
    given = (getattr(fs, "client_kwargs", None) or {}).get("endpoint_url") or getattr(fs, "endpoint_url", None)
    env = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    return redaction.recordable_url(given or env or "the AWS default endpoint")


def waiting_notice(fs, url: str) -> threading.Timer | None:
    """A timer that logs, once the first request of a remote store has waited ``WAIT_NOTICE_S``, what it waits
    for (the endpoint, the timeouts in force): credentials lookups and unreachable endpoints are otherwise silent."""
    if is_local(fs):
        return None
    config = getattr(fs, "config_kwargs", None) or {}
    limits = (f"; each try gives up after {config['connect_timeout']} s to connect, {config['read_timeout']} s "
              "to answer" if "connect_timeout" in config and "read_timeout" in config else "")
    timer = threading.Timer(WAIT_NOTICE_S, log.warning, ("waiting for %s: no answer yet from %s (credentials, "
                            "network, endpoint?)%s", redaction.recordable_url(url), endpoint_of(fs), limits))
    timer.daemon = True
    timer.start()
    return timer


def missing_bucket(fs: fsspec.AbstractFileSystem, root: str) -> str | None:
    """The bucket of an object-store ``root`` when it does not exist (else None, also when unsure)."""
    if is_local(fs):
        return None
    bucket = root.strip("/").split("/", 1)[0]
    try:
        return None if fs.exists(bucket) else bucket
    except Exception:  # denied or unreachable: say nothing rather than guess
        return None


def explain(e: BaseException, url: str, action: str, fs: fsspec.AbstractFileSystem | None = None,
            root: str = "") -> str:
    """One line for a failed ``action`` ("read" or "write") of store ``url`` that says what to do about it."""
    what = f"{type(e).__name__}: {e}"
    unreachable = isinstance(e, (ConnectionError, TimeoutError)) or "Connect" in type(e).__name__
    verb = "reach" if unreachable else "write to" if action == "write" else action
    cannot = f"cannot {verb} store {url!r}"
    if isinstance(e, PermissionError):
        return (f"{cannot}: access denied ({what}); check the credentials (AWS_PROFILE, "
                f"AWS_ACCESS_KEY_ID, -S profile=...) and that the bucket policy allows {action}s under this prefix")
    bucket = missing_bucket(fs, root) if fs is not None and isinstance(e, FileNotFoundError) else None
    if bucket:
        return f"{cannot}: bucket {bucket!r} does not exist (check the URL and the endpoint)"
    return f"{cannot}: {what}"


def put_atomic(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> str | None:
    """Write a small object so that readers see all of it or none of it; return its stamp (``stamp``), as a
    listing will show it, when the filesystem tells (None: unknown).

    Object stores give this for free (a PUT is atomic); on local disk write a temporary file
    beside it and rename.
    """
    if is_local(fs):
        parent = os.path.dirname(path)
        os.makedirs(parent, exist_ok=True)
        tmp = os.path.join(parent, f".tmp-{uuid.uuid4().hex}-{os.path.basename(path)}")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return stamp({"mtime": os.stat(path).st_mtime})
    response = fs.pipe_file(path, data)
    return stamp(response) if isinstance(response, dict) else None


def stamp(entry: dict[str, Any]) -> str | None:
    """What identifies one version of an object in a listing entry (or a PUT response): its ETag on object
    stores, its mtime on local disk; None when the filesystem gives neither. Two versions with the same
    stamp and size are taken to be the same bytes (an S3 ETag of a single PUT is the body's MD5)."""
    for key in ("ETag", "etag"):
        if entry.get(key):
            return "etag:" + str(entry[key]).strip('"')
    if entry.get("mtime") is not None:
        return f"mtime:{float(entry['mtime'])!r}"
    return None


def list_detail(fs: fsspec.AbstractFileSystem, path: str) -> dict[str, dict[str, Any]]:
    """Base name -> listing entry of the objects directly under ``path`` (empty when there is none): one
    paged LIST on object stores, sizes and stamps included, never from fsspec's listings cache (a store opened
    again in one process must see what was committed since). Local disk: ``os.scandir`` (fsspec's ``ls`` builds
    each entry through ``info``: 3x slower on 1e5 records)."""
    if is_local(fs):
        try:
            with os.scandir(path) as it:
                out = {}
                for d in it:  # links are listed as what they are (the door refuses to read them)
                    if d.is_dir(follow_symlinks=False):
                        continue
                    st = d.stat(follow_symlinks=False)
                    out[d.name] = {"name": d.path, "size": st.st_size, "mtime": st.st_mtime, "type": "file"}
                return out
        except (FileNotFoundError, NotADirectoryError):
            return {}
    try:
        entries = fs.ls(path, detail=True, refresh=True)
    except FileNotFoundError:
        return {}
    return {e["name"].rstrip("/").rsplit("/", 1)[-1]: e for e in entries if e.get("type") != "directory"}


def list_detail_split(fs: fsspec.AbstractFileSystem, path: str, splits: list[str]) -> dict[str, dict[str, Any]]:
    """``list_detail`` of an S3 prefix as concurrent ranges: base names sorted ``splits`` cut the key space into
    ``(None, s1], (s1, s2], ..., (sn, end)``, each listed (``StartAfter``, paged) up to its end, at most
    ``metadata_concurrency`` at once. Every key falls in exactly one range, so the union is the serial listing
    (a key added or removed meanwhile is seen or not, as in a serial listing). Entries: name, size, ETag (no
    LastModified: see ``_lister``). Not s3fs (or versioned): serial."""
    from s3fs import S3FileSystem

    if not isinstance(fs, S3FileSystem) or fs.version_aware or not splits:
        return list_detail(fs, path)
    import asyncio

    from fsspec.asyn import sync

    bucket, key, _ = fs.split_path(path)
    prefix = key.rstrip("/") + "/" if key else ""
    fs = _lister(fs)
    bounds = [None, *(prefix + s for s in sorted(set(splits))), None]

    async def one(after: str | None, stop: str | None) -> list[dict[str, Any]]:
        kw = dict(Bucket=bucket, Prefix=prefix, Delimiter="/", **fs.req_kw)
        if after is not None:
            kw["StartAfter"] = after
        out = []
        async with sem:
            async for page in fs._list_pages("list_objects_v2", **kw):
                done = False
                for c in page.get("Contents", []):
                    if stop is not None and c["Key"] > stop:
                        done = True
                        break
                    out.append({"name": f"{bucket}/{c['Key']}", "size": c["Size"], "ETag": c.get("ETag"),
                                "type": "file"})
                if done or (stop is not None and out and out[-1]["name"] == f"{bucket}/{stop}"):
                    break
        return out

    async def run() -> list[list[dict[str, Any]]]:
        nonlocal sem
        sem = asyncio.Semaphore(metadata_concurrency())  # made on the filesystem's loop
        return await asyncio.gather(*(one(a, b) for a, b in zip(bounds[:-1], bounds[1:])))

    from botocore.exceptions import ClientError
    from s3fs.errors import translate_boto_error

    sem: Any = None
    try:
        parts = sync(fs.loop, run)
    except ClientError as e:
        raise translate_boto_error(e) from None
    except FileNotFoundError:
        return {}
    return {e["name"].rsplit("/", 1)[-1]: e for part in parts for e in part}


_LISTERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _lister(fs):
    """``fs`` again (same options) for listings, on its own botocore session whose parser leaves timestamps as
    text: botocore spends ~70% of a 1,000-key ListObjectsV2 page turning each LastModified into a datetime
    (55 ms vs 16 ms a page here; 1e5 records: ~4 s of CPU), and hsstore never reads it (its stamp is the ETag).
    A session of its own, so that ``fs`` and its users keep their datetimes. A filesystem given its own
    ``session`` is used as it is."""
    if "session" in fs.storage_options:
        return fs
    got = _LISTERS.get(fs)
    if got is None:
        from aiobotocore.session import AioSession

        got = type(fs)(**fs.storage_options, skip_instance_cache=True)
        got.session, got._session_is_owned = AioSession(**got.kwargs), True
        got.session.get_component("response_parser_factory").set_parser_defaults(timestamp_parser=str)
        _LISTERS[fs] = got
    return got


def put_many(fs: fsspec.AbstractFileSystem, objects: dict[str, Any]) -> None:
    """Write many objects, each ``bytes`` or something with ``parts()`` (written without joining on
    local disk). Concurrent on async filesystems; parent folders are made on local disk."""
    if not objects:
        return
    if is_local(fs):
        for path in {os.path.dirname(p) for p in objects}:
            os.makedirs(path, exist_ok=True)
        # several files in flight: a disk (NVMe above all) needs queue depth, and each fsync waits
        list(_local_pool().map(lambda item: _write_local(*item), objects.items()))
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


def _write_local(path: str, data: Any) -> None:
    with open(path, "wb") as f:
        for part in (data.parts() if hasattr(data, "parts") else (data,)):
            f.write(part)
        # durable before the commit record that points at it: a power loss must not leave a committed
        # shard whose chunks never reached the disk
        f.flush()
        os.fsync(f.fileno())


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
    starts: list = [None] * len(paths)
    ends: list = [None] * len(paths)
    if sizes is not None and not is_local(fs):
        starts = [0 if n else None for n in sizes]
        ends = [n if n else None for n in sizes]  # an empty object takes no Range
    kw = {"batch_size": concurrency or metadata_concurrency()} if isinstance(fs, AsyncFileSystem) else {}
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


# "0": remote chunks are fetched as bytes objects and copied (``cat_verified``), as before ``cat_into``
STREAM_READS_ENV = "HSSTORE_STREAM_READS"


def stream_reads() -> bool:
    """Whether remote objects are streamed into the reader's buffers (``cat_into``; the default) rather than
    fetched whole as bytes and copied (``HSSTORE_STREAM_READS=0``, for paired comparison)."""
    return os.environ.get(STREAM_READS_ENV, "") != "0"


def cat_into(fs: fsspec.AbstractFileSystem, targets: dict[str, list[Any]],
             check: Callable[[str], str | None] | None = None, attempts: int = FETCH_ATTEMPTS,
             concurrency: int | None = None) -> dict[str, Exception | str | None]:
    """Whole objects straight into the caller's buffers: object ``path`` fills the contiguous writable buffers
    ``targets[path]`` in turn (as ``preadv`` does) with one ranged GET of their total size.

    Why: a body read as one bytes object is pieced together in fresh memory, twice (the HTTP parser's pieces,
    then their join), and a process that faults in every byte it receives spends 1.5-3 CPU-s per GB on that
    alone; streamed into buffers the loader recycles, the same reads cost ~0.8 (``tools/bench_source.py``).
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
    if not (hasattr(fs, "_call_s3") and stream_reads()):
        sizes = [sum(len(v) for v in vs) for vs in views.values()]
        blobs = cat_many(fs, list(views), sizes, concurrency)
        return {p: (b if isinstance(b, Exception) else _scatter(b, views[p])) for p, b in blobs.items()}
    from fsspec.asyn import sync

    async def run() -> dict[str, int | Exception]:
        import asyncio

        gate = asyncio.Semaphore(concurrency)

        async def one(path: str) -> int | Exception:
            async with gate:
                try:
                    return await _stream_s3(fs, path, views[path])
                except Exception as e:  # returned, as cat_many returns a failed read
                    return e

        paths = list(views)
        return dict(zip(paths, await asyncio.gather(*(one(p) for p in paths))))

    return sync(fs.loop, run)


def _scatter(blob: bytes, views: list[memoryview]) -> int:
    """Copy ``blob`` into ``views`` in turn (as much as they hold); the blob's size."""
    done, src = 0, memoryview(blob).cast("B")
    for v in views:
        n = min(len(v), len(src) - done)
        v[:n] = src[done:done + n]
        done += n
    return len(src)


async def _stream_s3(fs, path: str, views: list[memoryview]) -> int:
    """One ranged GET whose body is copied piece by piece into ``views``; a body cut mid-way (connection reset,
    fewer bytes than its Content-Length) is fetched again, s3fs's retry count and backoff, then raised."""
    import asyncio

    import aiohttp
    from s3fs.core import S3_RETRYABLE_ERRORS

    bucket, key, version = fs.split_path(path)
    want = sum(len(v) for v in views)
    extra = {"VersionId": version} if version else {}
    if want:
        extra["Range"] = f"bytes=0-{want - 1}"  # an empty object takes no Range (it has no byte 0)
    retryable = S3_RETRYABLE_ERRORS + (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError)
    tries = max(1, int(getattr(fs, "retries", 5)))
    for i in range(tries):
        resp = await fs._call_s3("get_object", Bucket=bucket, Key=key, **extra)
        body = resp["Body"]
        try:
            return await _copy_body(body, views)
        except retryable:
            if i + 1 >= tries:
                raise
            await asyncio.sleep(min(1.7 ** i * 0.1, 15))
        finally:
            body.close()
    raise AssertionError("unreachable")


async def _copy_body(body, views: list[memoryview]) -> int:
    """The body's bytes into ``views`` in turn; bytes beyond them are counted, not stored. aiohttp's pieces are
    copied as the parser hands them over; another HTTP client's body is read whole, then copied."""
    stream = getattr(getattr(body, "raw_stream", None), "content", None)
    if stream is None or not hasattr(stream, "iter_any"):
        return _scatter(await body.read(), views)
    k = off = done = 0
    async for piece in stream.iter_any():
        done += len(piece)
        piece, at = memoryview(piece), 0
        while at < len(piece) and k < len(views):
            n = min(len(views[k]) - off, len(piece) - at)
            views[k][off:off + n] = piece[at:at + n]
            at, off = at + n, off + n
            if off == len(views[k]):
                k, off = k + 1, 0
    return done


def _sizes_of(paths: list[str], sizes: dict[str, int] | None) -> list[int] | None:
    if not sizes or any(p not in sizes for p in paths):
        return None
    return [int(sizes[p]) for p in paths]


def fetch_failure(blob: Any) -> str | None:
    """None when ``blob`` is bytes or a missing object; else a one-line reason the read failed."""
    if isinstance(blob, Exception) and not isinstance(blob, FileNotFoundError):
        return f"{type(blob).__name__}: {blob}"
    return None
