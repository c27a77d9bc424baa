"""Where a store lives: fsspec URLs (local paths, ``s3://bucket/prefix``, anything fsspec knows).

One job: turn a URL plus storage options into a filesystem and a root path (retry defaults, the concurrency
requests may use, what a failure means in words). Listing objects is ``listing``'s job, moving bytes
``transfer``'s. Credentials given as storage options never appear in messages (see ``redaction``).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import warnings
from typing import Any

import fsspec
from fsspec.core import url_to_fs

from ..errors import StoreError
from .. import redaction
from ..redaction import register
from .backends import backend_for, backend_for_url
from .backends.base import INTERACTIVE, metadata_concurrency  # noqa: F401  (callers name it through storage)
from .backends.s3 import S3_RETRIES, S3FS_INTERACTIVE_RETRIES  # noqa: F401  (the S3 defaults, named here too)

log = logging.getLogger(__name__)


MANIFEST_FILE = "manifest.json"  # a folder is a store when this file is in it (docs/FORMAT.md)


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
    backend_for(fs).opened(fs, interactive)
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
    """``options`` plus hsstore's defaults for the URL's backend, each only where the user did not set it
    (``Backend.options``: S3's retry policy, connection pool and bounded session; HTTP's no redirects, no
    decoding and a deadline on the requests fsspec itself makes)."""
    return backend_for_url(url).options(options)


def interactive_options(url: str, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` for a command a person waits for (``Backend.interactive``: on S3 short timeouts and one retry,
    and the mark, ``INTERACTIVE``, that gives the filesystem s3fs's interactive ``retries``)."""
    return backend_for_url(url).interactive(options)


def join(*parts: str) -> str:
    return "/".join(p.strip("/") if i else p.rstrip("/") for i, p in enumerate(parts) if p != "")


def __getattr__(name: str) -> Any:
    """``is_local``, gone: a storage kind is the backend's to know (``backends.backend_for(fs).local_paths``)."""
    if name == "is_local":
        warnings.warn("hsstore.io.storage.is_local is deprecated: ask the backend, "
                      "hsstore.io.backends.backend_for(fs).local_paths", DeprecationWarning, stacklevel=2)
        return lambda fs: backend_for(fs).local_paths
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def missing_path(fs, root: str) -> str | None:
    """What is missing of a store path that is not there (a mistyped path is told apart from a folder that is
    not a store): locally the nearest folder above it that exists; on an object store, that nothing is under
    the prefix. None when the path exists (or the filesystem cannot tell)."""
    try:
        if backend_for(fs).local_paths:
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
    if backend_for(fs).local_paths:
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
    if backend_for(fs).local_paths:
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
