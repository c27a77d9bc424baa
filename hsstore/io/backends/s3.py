"""S3 through s3fs: every GET ``receive``'s (the bytes asked for, a deadline, a body cut mid-way fetched again),
bodies streamed into the caller's buffers as they arrive (``fill``), listings as concurrent key ranges whose
pages are each one bounded request, and a conditional PUT for create-if-absent."""

from __future__ import annotations

import asyncio
import copy
import weakref
from typing import Any

from .. import receive
from .base import INTERACTIVE, Bounded, metadata_concurrency

# Retry policy on object stores (see docs/ARCHITECTURE.md, "Faults and retries"). botocore retries every
# request (connection errors, 500/502/503/504, SlowDown and other throttling) with capped exponential
# backoff and full jitter; s3fs wraps each call in its own retries (connection/payload errors, SlowDown).
# Options the user gives (``config_kwargs.retries``) win.
S3_RETRIES = {"mode": "standard", "max_attempts": 6}
# Interactive commands (info, index, report, show) answer in seconds or fail saying why: a short connect
# timeout, botocore's one retry and no second round from s3fs (S3_RETRIES and s3fs's 5 rounds are for jobs
# that read or write for hours, and would take tens of seconds to report a closed endpoint).
S3_INTERACTIVE = {"connect_timeout": 3, "read_timeout": 15, "retries": {"mode": "standard", "total_max_attempts": 2}}
S3FS_INTERACTIVE_RETRIES = 1


class S3Backend(Bounded):
    name = "s3"
    protocols = ("s3", "s3a")

    @staticmethod
    async def fetch(fs, path: str, start: int, end: int, size: int | None = None) -> bytes:
        return await receive.s3_get(fs, path, start, end)

    def matches(self, fs) -> bool:
        return type(fs).__name__ == "S3FileSystem"

    def options(self, options: dict[str, Any]) -> dict[str, Any]:
        """botocore's retry policy, a connection pool as large as the metadata concurrency and the session that
        bounds every request (``receive.session_class``)."""
        out = copy.deepcopy(options)
        config = out.setdefault("config_kwargs", {})
        if isinstance(config, dict):
            config.setdefault("retries", dict(S3_RETRIES))
            config.setdefault("max_pool_connections", max(10, metadata_concurrency()))
            bounded = receive.session_class()
            if bounded is not None:
                config.setdefault("http_session_cls", bounded)
        return out

    def interactive(self, options: dict[str, Any]) -> dict[str, Any]:
        """``S3_INTERACTIVE`` (botocore's timeouts and retries, as ``config_kwargs``, each only where the user did
        not set it), and the mark that gives the filesystem s3fs's interactive ``retries`` (an attribute of the
        filesystem, not an option s3fs takes)."""
        out = copy.deepcopy(options)
        config = out.setdefault("config_kwargs", {})
        if isinstance(config, dict):
            for key, value in S3_INTERACTIVE.items():
                config.setdefault(key, copy.deepcopy(value))
        out[INTERACTIVE] = True
        return out

    def opened(self, fs, interactive: bool) -> None:
        """s3fs's own rounds around botocore's attempts: one for a command a person waits for."""
        if interactive:
            fs.retries = S3FS_INTERACTIVE_RETRIES

    def fill(self, fs, views: dict[str, list[memoryview]], concurrency: int) -> dict[str, int | Exception]:
        """Each body's pieces copied into the views as s3fs's client hands them over (``receive.s3_into``)."""
        from fsspec.asyn import sync

        async def run() -> dict[str, int | Exception]:
            gate = asyncio.Semaphore(concurrency)

            async def one(path: str) -> int | Exception:
                async with gate:
                    try:
                        return await receive.s3_into(fs, path, views[path])
                    except Exception as e:  # returned, as read_objects returns a failed read
                        return e

            paths = list(views)
            return dict(zip(paths, await asyncio.gather(*(one(p) for p in paths))))

        return sync(fs.loop, run)

    def list_detail(self, fs, path: str, splits: list[str] | None = None, concurrency: int = 1
                    ) -> dict[str, dict[str, Any]]:
        if fs.version_aware:
            return super().list_detail(fs, path)
        return list_ranges(fs, path, list(splits or []), concurrency)

    def list_names(self, fs, path: str) -> list[str]:
        if fs.version_aware:
            return super().list_names(fs, path)
        return sorted(list_ranges(fs, path, [], 1, folders=True))


def list_ranges(fs, path: str, splits: list[str], concurrency: int, folders: bool = False
                ) -> dict[str, dict[str, Any]]:
    """Base name -> entry of an S3 prefix listed as concurrent ranges: base names sorted ``splits`` cut the key
    space into ``(None, s1], (s1, s2], ..., (sn, end)``, each listed (``StartAfter``, paged) up to its end, at most
    ``concurrency`` at once (no splits: one range). Every key falls in exactly one range, so the union is the
    serial listing (a key added or removed meanwhile is seen or not, as in a serial listing). Entries: name, size,
    ETag (no LastModified: see ``_lister``). Every page is one bounded request (``receive``: deadline, size), at
    most ``receive.LIST_PAGES`` of them per listing. ``folders``: the common prefixes too (as entries of type
    "directory")."""
    bucket, key, _ = fs.split_path(path)
    prefix = key.rstrip("/") + "/" if key else ""
    fs = _lister(fs)
    bounds = [None, *(prefix + s for s in sorted(set(splits))), None]
    pages = 0

    async def one(after: str | None, stop: str | None) -> list[dict[str, Any]]:
        nonlocal pages
        kw = dict(Bucket=bucket, Prefix=prefix, Delimiter="/", **fs.req_kw)
        if after is not None:
            kw["StartAfter"] = after
        out: list[dict[str, Any]] = []
        last: str | None = None
        async with sem:
            while True:
                pages += 1
                if pages > receive.LIST_PAGES:
                    raise receive.AnswerRefused(f"listing of s3://{bucket}/{prefix}", f"more than {receive.LIST_PAGES:,} "
                                                                                "pages; an endless listing?")
                page = await fs._call_s3("list_objects_v2", **kw)
                keys = [c["Key"] for c in page.get("Contents", [])] + [c["Prefix"] for c in
                                                                       page.get("CommonPrefixes", [])]
                if last is not None and any(k <= last for k in keys):  # a listing only moves forward
                    raise receive.AnswerRefused(f"listing of s3://{bucket}/{prefix}", "a page repeats or goes back "
                                                                                "before the last one; an endless listing?")
                last = max(keys, default=last)
                done = False
                if folders:
                    out += [{"name": f"{bucket}/{c['Prefix'].rstrip('/')}", "size": 0, "type": "directory"}
                            for c in page.get("CommonPrefixes", [])]
                for c in page.get("Contents", []):
                    if stop is not None and c["Key"] > stop:
                        done = True
                        break
                    out.append({"name": f"{bucket}/{c['Key']}", "size": c["Size"], "ETag": c.get("ETag"),
                                "type": "file"})
                if done or (stop is not None and out and out[-1]["name"] == f"{bucket}/{stop}"):
                    break
                token = page.get("NextContinuationToken")
                if not page.get("IsTruncated") or not token:
                    break
                kw.pop("StartAfter", None)
                kw["ContinuationToken"] = token
        return out

    async def run() -> list[list[dict[str, Any]]]:
        nonlocal sem
        sem = asyncio.Semaphore(max(1, concurrency))  # made on the filesystem's loop
        return await asyncio.gather(*(one(a, b) for a, b in zip(bounds[:-1], bounds[1:])))

    sem: Any = None
    parts = _listed(fs, run, path)
    return {e["name"].rsplit("/", 1)[-1]: e for part in parts for e in part
            if folders or e["type"] == "file"}


def _listed(fs, run, path: str) -> list:
    """``run()`` on ``fs``'s loop, its failures as a user is told them: S3's own errors as s3fs translates them,
    a listing that is not there as empty, a page cut short or a connection lost (after the retries) one
    ``OSError`` line."""
    import aiohttp
    from botocore.exceptions import BotoCoreError, ClientError
    from fsspec.asyn import sync
    from s3fs.errors import translate_boto_error

    try:
        return sync(fs.loop, run)
    except ClientError as e:
        raise translate_boto_error(e) from None
    except FileNotFoundError:
        return []
    except (aiohttp.ClientError, BotoCoreError) as e:
        raise OSError(f"listing of {path}: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]} (after "
                      "retries)") from None


_LISTERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _lister(fs):
    """``fs`` again (same options) for listings, on its own botocore session whose parser leaves timestamps as
    text: botocore spends most of a ListObjectsV2 page's parse turning each LastModified into a datetime
    (docs/PERFORMANCE.md, "Design choices"), and hsstore never reads it (its stamp is the ETag).
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


