"""Names read from a store -> paths and keys under the root they belong to (docs/FORMAT.md, "Names").

A store from another team is untrusted input, and so is every name in it: asset names (``assets/index.json``),
shard names and file keys (commit records), ``location``s (shards merged by reference), index segment names and
their ``supersedes``, and the chunk-cache keys made from them. Archive extractors refuse member names that leave
their target; these functions do the same for a store, in one place, so that no reader, copier, cache or
deleter joins a store's name with a root on its own. A refused name is a ``StoreError`` whose one line names the
store (or file) and the name.
"""

from __future__ import annotations

import os
from typing import Iterable, Sequence

from .. import env
from ..io import storage
from ..io.backends import backend_for, backend_for_url
from ..io.door import key_problem, percent_decoded
from ..errors import StoreError

# never a location, whatever is allowed: a store's shard read from here would read the machine's own files
SYSTEM_DIRS = ("/etc", "/proc", "/sys", "/dev", "/boot", "/root", "/run", "/bin", "/sbin", "/lib", "/lib32",
               "/lib64", "/usr", "/var/run", "/var/log", "/var/lib", "/var/spool")


def _refuse(where: str, what: str, name, why: str) -> StoreError:
    return StoreError(f"{where}: {what} {name!r} refused ({why})")


def key(name, what: str, where: str) -> str:
    """``name`` as a relative key (``a/b/c``), else ``StoreError``: empty, absolute, ``.``/``..`` or empty
    parts, backslashes and NUL are refused (an S3 key ``assets/../../x`` is just a key, but a path joined
    with it is not under the root)."""
    why = key_problem(name)
    if why:
        raise _refuse(where, what, name, why)
    return name


def part(name, what: str, where: str) -> str:
    """``name`` as one path part (a shard or segment name): ``key`` and no ``/``."""
    key(name, what, where)
    if "/" in percent_decoded(name):
        raise _refuse(where, what, name, "a '/' in a single name (percent-decoded too)")
    return name


def path(fs, root: str, name, what: str, where: str) -> str:
    """The path of key ``name`` under ``root`` (``key``'s rules); on local disk also refused when it resolves
    (through symbolic links in the store) outside ``root``."""
    p = storage.join(root, key(name, what, where))
    if backend_for(fs).local_paths:
        contained(root, p, what, name, where)
    return p


def contained(root: str, p: str, what: str, name, where: str) -> None:
    """Refuse local path ``p`` (for ``name``) unless it resolves inside ``root``."""
    real_root = os.path.realpath(root)
    real = os.path.realpath(p)
    if real != real_root and not real.startswith(real_root.rstrip(os.sep) + os.sep):
        raise _refuse(where, what, name, f"resolves to {real}, outside {real_root} (a link in the store?)")


def file_key(shard: str, name, where: str) -> str:
    """A commit record's file key: ``key``'s rules and under the shard's own prefix (``shards/<shard>/...`` or
    ``shards/<shard>.tar``), so a copy of one shard can never overwrite another shard's files."""
    key(name, "file key", where)
    if not (name == f"shards/{shard}.tar" or name.startswith(f"shards/{shard}/")):
        raise _refuse(where, "file key", name, f"not under the shard's own prefix shards/{shard}")
    return name


def record_problems(rec) -> list[tuple[str, str]]:
    """(file key or "(shard name)", why) of every name in a commit record that readers refuse: the shard name,
    then each file key (``verify`` reports them instead of following them)."""
    where = f"shard {rec.shard!r}"
    try:
        part(rec.shard, "shard name", where)
    except StoreError as e:
        return [("(shard name)", str(e))]
    out = []
    for k in rec.files:
        try:
            file_key(rec.shard, k, where)
        except StoreError as e:
            out.append((str(k), str(e)))
    return out


# -- locations (shards merged by reference) ----------------------------------------------------------------
_COMMAND_ALLOWS: list[str] = []  # the running command's --allow-location prefixes (``allow_for_command``)


def allow_for_command(prefixes: Iterable[str]) -> None:
    """Allow ``prefixes`` for every store the running command opens: the command line hands its
    ``--allow-location`` values here, once, before the command runs. A store keeps what it was allowed
    (``Store.allow_locations``), so its copies in workers need nothing more."""
    _COMMAND_ALLOWS[:] = [p for p in prefixes if p]


def allowed(extra: Iterable[str] | None = None) -> list[str]:
    """The prefixes a ``location`` may point into besides the store itself: ``extra`` (``hsstore.open(...,
    allow_locations=...)``), the command's ``--allow-location`` (``allow_for_command``) and
    ``env.ALLOW_LOCATIONS``, each once, in that order."""
    return list(dict.fromkeys([*(extra or ()), *_COMMAND_ALLOWS, *env.ALLOW_LOCATIONS.get()]))


def _local_url(url: str) -> bool:
    """Whether ``url`` names a local path (its backend's objects are files at local paths)."""
    return backend_for_url(url).local_paths


def _local_path(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    return os.path.realpath(rest if sep else url)


def _inside(url: str, prefix: str) -> bool:
    if _local_url(url) != _local_url(prefix):
        return False
    if _local_url(url):
        u, p = _local_path(url), _local_path(prefix)
        return u == p or u.startswith(p.rstrip(os.sep) + os.sep)
    u, p = url.rstrip("/"), prefix.rstrip("/")
    return u == p or u.startswith(p + "/")


def _location_parts_problem(loc: str, leading_up: bool = True) -> str | None:
    """Why a ``location`` string's parts are refused (None: they are not): a backslash or NUL, an empty, ``.`` or
    ``..`` part (``..`` only leading a relative location, and only where ``leading_up``)."""
    if "\\" in loc or "\x00" in loc:
        return "a backslash or NUL in it"
    scheme, sep, rest = loc.partition("://")
    if sep:
        parts = rest.rstrip("/").split("/")
    elif loc.startswith("/"):
        parts = loc.rstrip("/").split("/")[1:]
    else:
        parts = loc.rstrip("/").split("/")
        while leading_up and parts and parts[0] == "..":
            parts = parts[1:]
    if parts and ("" in parts or "." in parts or ".." in parts):
        return "an empty, '.' or '..' part"
    return None


def location(store_url: str, loc, allow: Sequence[str] = (), where: str = "") -> str:
    """The URL of a commit record's ``location``, else ``StoreError``. Relative locations resolve against the
    store's URL (``commit.resolve_location``). Refused: bad parts (``..`` anywhere but leading a relative
    location, ``.``, empty parts, backslashes), any location outside the store unless it lies under one of
    ``allow`` (``allowed()``), and a local system directory (``SYSTEM_DIRS``) always."""
    from .commit import resolve_location

    where = where or f"store {store_url!r}"
    if not isinstance(loc, str) or not loc:
        raise _refuse(where, "location", loc, "empty or not a string")
    why = _location_parts_problem(loc)
    decoded = percent_decoded(loc)
    if why is None and decoded != loc:  # as a server or URL library decodes it: no '..' at all
        why = _location_parts_problem(decoded, leading_up=False)
        why = why and f"percent-encoded: {why} once decoded"
    if why:
        raise _refuse(where, "location", loc, why)
    try:
        url = resolve_location(store_url, loc.rstrip("/") or loc)
    except StoreError as e:
        raise _refuse(where, "location", loc, str(e)) from None
    if _local_url(url):
        real = _local_path(url)
        if real == "/" or any(real == d or real.startswith(d + "/") for d in SYSTEM_DIRS):
            raise _refuse(where, "location", loc, f"{real} is a local system path")
    if _inside(url, store_url) or any(_inside(url, p) for p in allow):
        return url
    raise _refuse(where, "location", loc, f"{url} is outside the store; a store by reference is read only from "
                                          "prefixes allowed with --allow-location PREFIX or "
                                          f"{env.ALLOW_LOCATIONS.name}")


# -- the chunk cache ---------------------------------------------------------------------------------------
def cache_key(cache_root: str, namespace: str, remote_path: str) -> str:
    """The key (relative to the cache folder) under which the chunk cache keeps a copy of a remote object:
    ``namespace/<remote path>``, never outside (the remote path is made of the store's names)."""
    where = f"chunk cache {cache_root!r}"
    name = remote_path
    if "://" in name:  # filesystems that key objects by URL (http): scheme and user info are no part of the name
        netloc, _, rest = name.split("://", 1)[1].partition("/")
        name = netloc.rpartition("@")[2] + "/" + rest
    name = name.lstrip("/")
    return f"{part(namespace, 'namespace', where)}/{key(name, 'chunk path', where)}"
