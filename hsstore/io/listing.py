"""Listing a store's objects: names, sizes and stamps (what identifies one version of an object) under a prefix,
in one paged LIST, or as concurrent key ranges on S3 (``list_detail_split``). Never from fsspec's listings cache:
a store opened again in one process must see what was committed since."""

from __future__ import annotations

from typing import Any

import fsspec

from .backends import backend_for
from .backends.base import metadata_concurrency


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
    each entry through ``info``: 3x slower on 1e5 records). An HTML index page gives no sizes (each object's
    read is bounded instead)."""
    return backend_for(fs).list_detail(fs, path)


def list_names(fs, path: str) -> list[str]:
    """Base names of everything directly under ``path``, folders included (``verify``'s look at ``shards/``),
    bounded as every listing is."""
    return backend_for(fs).list_names(fs, path)


def list_detail_split(fs: fsspec.AbstractFileSystem, path: str, splits: list[str]) -> dict[str, dict[str, Any]]:
    """``list_detail`` of a prefix as concurrent ranges where the backend lists so (S3): base names sorted
    ``splits`` cut the key space into ``(None, s1], (s1, s2], ..., (sn, end)``, each listed up to its end, at most
    ``metadata_concurrency`` at once; the union is the serial listing. Elsewhere: ``list_detail``."""
    return backend_for(fs).list_detail(fs, path, splits=splits, concurrency=metadata_concurrency())
