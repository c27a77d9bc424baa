"""Listing a store's objects: names, sizes and stamps (what identifies one version of an object) under a prefix,
in one paged LIST, or as concurrent key ranges on S3 (``list_detail_split``). Never from fsspec's listings cache:
a store opened again in one process must see what was committed since."""

from __future__ import annotations

import weakref
import os
from typing import Any

import fsspec

from . import receive
from .storage import is_local, metadata_concurrency


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
    if receive.is_http(fs):  # the HTML index page, bounded (sizes unknown: each object's read is bounded instead)
        from fsspec.asyn import sync

        try:
            names = sync(fs.loop, receive.http_list, fs, path)
        except FileNotFoundError:
            return {}
        base = path.rstrip("/")
        return {n: {"name": f"{base}/{n}", "size": None, "type": "file"} for n in names if not n.endswith("/")}
    if receive.is_s3(fs) and not fs.version_aware:
        return list_detail_split(fs, path, [], serial=True)
    try:
        entries = fs.ls(path, detail=True, refresh=True)
    except FileNotFoundError:
        return {}
    return {e["name"].rstrip("/").rsplit("/", 1)[-1]: e for e in entries if e.get("type") != "directory"}


def list_names(fs, path: str) -> list[str]:
    """Base names of everything directly under ``path``, folders included (``verify``'s look at ``shards/``),
    bounded as every listing is."""
    if is_local(fs):
        try:
            return sorted(os.listdir(path))
        except (FileNotFoundError, NotADirectoryError):
            return []
    if receive.is_http(fs):
        from fsspec.asyn import sync

        try:
            return [n.rstrip("/") for n in sync(fs.loop, receive.http_list, fs, path)]
        except FileNotFoundError:
            return []
    if receive.is_s3(fs) and not fs.version_aware:
        return sorted(list_detail_split(fs, path, [], serial=True, folders=True))
    try:
        return [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False, refresh=True)]
    except FileNotFoundError:
        return []


def list_detail_split(fs: fsspec.AbstractFileSystem, path: str, splits: list[str], serial: bool = False,
                      folders: bool = False) -> dict[str, dict[str, Any]]:
    """``list_detail`` of an S3 prefix as concurrent ranges: base names sorted ``splits`` cut the key space into
    ``(None, s1], (s1, s2], ..., (sn, end)``, each listed (``StartAfter``, paged) up to its end, at most
    ``metadata_concurrency`` at once. Every key falls in exactly one range, so the union is the serial listing
    (a key added or removed meanwhile is seen or not, as in a serial listing). Entries: name, size, ETag (no
    LastModified: see ``_lister``). Not s3fs (or versioned): serial. Every page is one bounded request
    (``receive``: deadline, size), at most ``receive.LIST_PAGES`` of them per listing. ``serial``: one range
    (``list_detail`` of S3); ``folders``: the common prefixes too (as entries of type "directory")."""
    from s3fs import S3FileSystem

    if not isinstance(fs, S3FileSystem) or fs.version_aware or not (splits or serial):
        return list_detail(fs, path)
    import asyncio


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
        sem = asyncio.Semaphore(metadata_concurrency())  # made on the filesystem's loop
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


