"""Where a writing command writes: its destination checked before any write, and the lock that serialises the
commands that copy into one store (subset, merge, convert, import).

A destination is refused (``DestinationError``, nothing written) when it is a user's folder rather than a store
or an empty place; a destination is written by one copying command at a time (``hold_lock``), since two would
each find no sample committed and copy every one. Extraction's torchrun ranks and ``StoreWriter``s need no lock:
their shard names are unique per session.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
import uuid
from typing import Any, Callable

import fsspec

from ..errors import StoreError
from ..terminal import escape, shown
from . import door, storage
from .backends import backend_for, backend_for_url
from .listing import list_names
from .storage import MANIFEST_FILE, explain, join, resolve

log = logging.getLogger(__name__)

class DestinationError(StoreError):
    """A writing command was pointed at something that is not its own kind of output (a user's folder)."""


# What hsstore itself puts in a store folder before its manifest: the lock of a job that writes into it
# (``hold_lock``) and the temporary names of atomic writes. Anything else there before a manifest is the user's.
LOCKS_DIR = "locks"


def open_destination(url: str, options: dict[str, Any] | None = None, own: dict[str, bytes] | None = None,
                     ) -> tuple[fsspec.AbstractFileSystem, str]:
    """(filesystem, root) of a store about to be written: the one way every writer (``StoreWriter``,
    ``convert``, ``merge``, ``subset``, ``import``, ``extract``) opens its destination, so each refuses the same
    way, before any write: storage without a write side (an HTTP server), an anonymous write, and an existing folder
    or prefix that holds anything but an hsstore store (``check_destination``; ``own``: ``layout.own_objects()``)."""
    backend = backend_for_url(url)
    if not backend.writable:
        raise DestinationError(f"destination {shown(url)}: {backend.name} storage is read only (nothing was written)")
    refuse_anonymous_write(url, options)
    fs, root = resolve(url, options)
    check_destination(fs, root, url, own or {})
    return fs, root


def check_destination(fs: fsspec.AbstractFileSystem, root: str, url: str, own: dict[str, bytes]) -> None:
    """Refuse (``DestinationError``, nothing written) a destination that exists, is not empty and is not an
    hsstore store: writing there would mix a store into the user's files and overwrite same-named ones (an
    existing zarr group's ``zarr.json``, a ``config.json``). A store (its manifest is there) is resumed; what
    hsstore itself writes before the manifest (a job lock, the layout's own root objects byte for byte, the
    temporary files of atomic writes) does not count. ``own``: the layouts' root objects (key -> bytes)."""
    if storage.store_exists(fs, root, url):
        return
    try:
        entries = backend_for(fs).entries(fs, root)
    except FileNotFoundError:
        return
    except NotADirectoryError:
        raise DestinationError(f"destination {url!r} exists and is not a folder: nothing was written") from None
    except Exception as e:
        raise StoreError(explain(e, url, "read", fs, root)) from None
    foreign = sorted(name for name, is_dir in entries.items() if not _hsstore_own(fs, root, name, is_dir, own))
    if MANIFEST_FILE in foreign and storage.store_exists(fs, root, url):  # another writer made the store meanwhile
        return
    if foreign:
        shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
        raise DestinationError(f"destination {url!r} exists, is not empty ({shown}) and is not an hsstore store: "
                               "give a new or empty folder (nothing was written)")


def _hsstore_own(fs, root: str, name: str, is_dir: bool, own: dict[str, bytes]) -> bool:
    """Whether an entry of a store folder without a manifest is one hsstore writes while creating a store."""
    if name.startswith(".tmp-") or (name == LOCKS_DIR and is_dir):
        return True
    if is_dir:  # a folder of the layout's own objects only (zarr's shards/zarr.json)
        inside = {k[len(name) + 1:] for k in own if k.startswith(name + "/")}
        if not inside:
            return False
        found = {f for f in list_names(fs, join(root, name)) if not f.startswith(".tmp-")}  # another writer's atomic write in flight
        return found <= inside and all(_same_bytes(fs, root, f"{name}/{f}", own[f"{name}/{f}"]) for f in found)
    return name in own and _same_bytes(fs, root, name, own[name])


def _same_bytes(fs, root: str, key: str, data: bytes) -> bool:
    """Whether object ``key`` holds exactly ``data`` (read through the door, at most one byte more)."""
    try:
        return door.read(fs, root, key, bound=len(data) + 1) == data
    except Exception:
        return False


def check_output_folder(path: str | os.PathLike, own: tuple[str, ...], what: str) -> None:
    """The same rule for a command's local output folder (``train --out``, ``export``): refuse (one line,
    nothing written) an existing folder that is not empty and holds none of ``own``, the names that mark the
    command's own earlier work (its resume). ``own`` empty: only a new or empty folder is taken."""
    path = os.fspath(path)
    if not os.path.exists(path):
        return
    if not os.path.isdir(path):
        raise DestinationError(f"{what} {path}: exists and is not a folder (nothing was written)")
    entries = sorted(os.listdir(path))
    if entries and not any(name in entries for name in own):
        shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
        mine = f" and is not {what}'s own work (no {' or '.join(own)})" if own else ""
        raise DestinationError(f"{what} {path}: not empty ({shown}){mine}: give a new or empty folder "
                               "(nothing was written)")


@contextlib.contextmanager
def removed_if_left_empty(path: str | os.PathLike):
    """Around a command that makes its local output folder (``train --out``): when it fails, the folder and the
    parents it made are removed again while they are empty, so a failed run leaves no empty folder behind. What
    existed before, or holds anything, is kept."""
    made = []
    p = os.path.abspath(os.fspath(path))
    while not os.path.lexists(p) and os.path.dirname(p) != p:
        made.append(p)  # deepest first
        p = os.path.dirname(p)
    try:
        yield
    except BaseException:
        for d in made:
            try:
                os.rmdir(d)  # only an empty folder (never a link, a file or a folder with anything in it)
            except OSError:
                break
        raise


class LockHeld(StoreError):
    """Another job holds the lock of a destination (two writers would duplicate its samples)."""


def create_exclusive(fs: fsspec.AbstractFileSystem, path: str, data: bytes, root: str | None = None) -> bool:
    """Create a small object only when nothing is at ``path`` (False: something is). Local disk: ``O_EXCL``,
    no folder below ``root`` (the store's) followed when it is a link (``sinks``); S3: a conditional PUT
    (``If-None-Match: *``, which S3 applies atomically: of two racing PUTs one fails). Another object store
    that cannot say so raises ``StoreError`` rather than guess."""
    return backend_for(fs).create_exclusive(fs, path, data, root)


def take_over(fs: fsspec.AbstractFileSystem, root: str, path: str, token: str, still: Callable[[], bool],
              replace: Callable[[], None], me: bytes) -> bool:
    """Replace the object at ``path`` of a holder that no longer runs, as its one taker: ``<path>.<token>.takeover``
    (``token`` names the dead holder) is created exclusively first, and ``replace()`` runs only while ``still()``
    says the dead holder's object is there. False: another process is taking it over (look again at who holds it
    then), or it was replaced meanwhile. Of several takers of one dead holder exactly one replaces it."""
    marker = f"{path}.{token if token.isalnum() else 'x'}.takeover"
    if not create_exclusive(fs, marker, me, root):
        time.sleep(0.2)
        return False
    try:
        if not still():
            return False
        replace()
        return True
    finally:
        with contextlib.suppress(Exception):
            backend_for(fs).delete(fs, marker, root)


LOCK = "write"  # one lock for every copying command: a subset and a merge into one store at once duplicate too


def hold_lock(fs: fsspec.AbstractFileSystem, root: str, url: str, command: str):
    """A context manager holding ``<root>/locks/write.lock`` while ``hsstore <command>`` (subset, merge,
    convert, import) copies into a destination: two copying commands into one new store would each find no
    sample committed and copy every one. Created exclusively (``create_exclusive``), removed at the end. A lock
    left by a process of this machine that no longer runs (a crash, a kill) is taken over atomically: the taker
    first creates ``<lock>.<its token>.takeover`` exclusively, so of two takers of one dead lock only one
    replaces it, and the other then finds the new holder. Any other lock is refused in one line naming it."""
    path = join(root, LOCKS_DIR, f"{LOCK}.lock")
    rel = f"{LOCKS_DIR}/{LOCK}.lock"
    me = {"host": socket.gethostname(), "pid": os.getpid(), "token": uuid.uuid4().hex, "command": command,
          "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

    def refuse(other: dict) -> LockHeld:
        return LockHeld(f"another `hsstore {escape(other.get('command', 'subset'))}` is writing into {url!r} "
                        f"(lock {rel}: host {shown(other.get('host'))}, pid {shown(other.get('pid'))}, started "
                        f"{shown(other.get('started'))}); wait for it, or remove that object if no such job runs")

    def take_over_lock(other: dict) -> None:
        """Remove the dead holder's lock, as the one taker of it (its token names the takeover marker)."""
        def remove() -> None:
            log.warning("taking over %s of process %s, which is gone", rel, other["pid"])
            backend.delete(fs, path, root)

        take_over(fs, root, path, str(other.get("token", "")), lambda: _read_lock(fs, root, rel) == other, remove,
                  json.dumps(me).encode())

    backend = backend_for(fs)
    existed = backend.local_paths and os.path.exists(root)

    @contextlib.contextmanager
    def held():
        for _ in range(3):
            if create_exclusive(fs, path, json.dumps(me).encode(), root):
                break
            other = _read_lock(fs, root, rel)
            if other is None:
                continue  # released meanwhile: try again
            if not (other.get("host") == me["host"] and isinstance(other.get("pid"), int)
                    and not isinstance(other.get("pid"), bool) and not pid_alive(other["pid"])):
                raise refuse(other)
            take_over_lock(other)
        else:
            raise LockHeld(f"could not take {rel} of {url!r}: another job keeps taking it (or a takeover died: "
                           f"remove {rel} and {rel}.*.takeover if no hsstore job writes there)")
        try:
            yield
        finally:
            try:
                backend.delete(fs, path, root)
            except Exception as e:  # the job's work is done either way
                log.warning("could not remove %s (%s); remove it before the next `hsstore %s`", path, e, command)
            if backend.local_paths:  # a refused job leaves no folder behind (only empty ones are removed)
                for folder in [join(root, LOCKS_DIR)] + ([] if existed else [root]):
                    with contextlib.suppress(OSError):
                        os.rmdir(folder)

    return held()


def _read_lock(fs, root: str, rel: str) -> dict | None:
    """A lock's JSON (None: gone); a lock that does not parse is an empty dict (held by an unknown job)."""
    try:
        got = door.read_json(fs, root, rel, where=rel)
    except FileNotFoundError:
        return None
    except Exception:
        return {}
    return got if isinstance(got, dict) else {}


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this machine (one of another user's counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True




def refuse_anonymous_write(url: str, options: dict[str, Any] | None) -> None:
    """Anonymous (unsigned) access is for reading shared stores; a write attempted with it would either fail
    half-way on a real bucket or, worse, succeed on a misconfigured one. Refuse before anything is written."""
    if str((options or {}).get("anon", "")).lower() in ("true", "1"):
        raise StoreError(f"store {url!r}: anon=true opens a store read-only; to write, drop the anon "
                         "storage option and give credentials")


