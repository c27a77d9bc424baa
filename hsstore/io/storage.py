"""Where a store lives: fsspec URLs (local paths, ``s3://bucket/prefix``, anything fsspec knows).

One job: turn a URL plus storage options into a filesystem and a root path (retry defaults, the concurrency
requests may use, what a failure means in words). Listing objects is ``listing``'s job, moving bytes
``transfer``'s. Credentials given as storage options never appear in messages (see ``redaction``).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import threading
from typing import Any

import fsspec
from fsspec.core import url_to_fs

from ..errors import StoreError
from .. import env, redaction
from ..redaction import register

log = logging.getLogger(__name__)


# Retry policy on object stores (see docs/ARCHITECTURE.md, "Faults and retries"). botocore retries every
# request (connection errors, 500/502/503/504, SlowDown and other throttling) with capped exponential
# backoff and full jitter; s3fs wraps each call in its own retries (connection/payload errors, SlowDown).
# Options the user gives (``config_kwargs.retries``) win.
S3_RETRIES = {"mode": "standard", "max_attempts": 6}
MANIFEST_FILE = "manifest.json"  # a folder is a store when this file is in it (docs/FORMAT.md)


def metadata_concurrency() -> int:
    """Requests in flight for small-object reads (``env.METADATA_CONCURRENCY``): latency, not bandwidth, is what
    commit records and index segments cost, so many at once; s3fs's connection pool is raised to match."""
    return env.METADATA_CONCURRENCY.get()


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
    """``options`` plus hsstore's defaults, each only where the user did not set it: for ``s3://`` URLs botocore's
    retry policy, a connection pool as large as the metadata concurrency and the session that bounds every
    request (``receive.session_class``); for ``http(s)://`` URLs no redirects followed, no bodies decoded and a
    deadline on the requests fsspec itself makes (``HEAD``: ``receive.request_s()``); hsstore's GETs and listings
    are ``receive``'s, bounded as they are made."""
    if url.startswith(("http://", "https://")):
        import aiohttp

        from . import receive

        out = copy.copy(options)
        out.setdefault("allow_redirects", False)
        client = dict(out.get("client_kwargs") or {})
        client.setdefault("auto_decompress", False)
        client.setdefault("timeout", aiohttp.ClientTimeout(total=receive.request_s()))
        out["client_kwargs"] = client
        return out
    if not url.startswith(("s3://", "s3a://")):
        return options
    from . import receive

    out = copy.deepcopy(options)
    config = out.setdefault("config_kwargs", {})
    if isinstance(config, dict):
        config.setdefault("retries", dict(S3_RETRIES))
        config.setdefault("max_pool_connections", max(10, metadata_concurrency()))
        bounded = receive.session_class()
        if bounded is not None:
            config.setdefault("http_session_cls", bounded)
    return out


# Interactive commands (info, index, report, show) answer in seconds or fail saying why: a short connect
# timeout, botocore's one retry and no second round from s3fs (S3_RETRIES and s3fs's 5 rounds are for jobs
# that read or write for hours, and would take tens of seconds to report a closed endpoint).
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
