"""The storage backend protocol: what hsstore asks of a place where a store's objects live, and nothing else.

A backend is told apart from the others once, by its filesystem (``matches``) or its URL (``matches_url``), and
then answers for its kind: the callers (the door, transfers, listings, destinations, names, the loader) ask it
what it can do and never test which kind it is. The read side is every backend's: ranged GETs (``get_ranges``,
``get``), whole objects of known sizes (``read_objects``), whole objects straight into buffers (``fill``), one
streaming pass (``open_ranged``), a size declared without reading (``size``) and listings (``list_detail``,
``list_names``). The write side is a writable backend's (``writable``): an atomic put (``put_atomic``), many
objects (``put_many``), create-if-absent (``create_exclusive``) and the removal of an object it wrote
(``delete``). What a read may cost -- bounds, deadlines, links and FIFOs refused -- is the door's and
``receive``'s; a backend supplies the primitive that the door bounds.

``Backend`` itself is any fsspec filesystem no registered backend claims (``memory://``, a gcsfs or adlfs
filesystem): fsspec's own calls, bounded only by what they ask for. The shipped contract suite
(``hsstore/testing/backend_contract.py``) says what every backend owes.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from fsspec.asyn import AsyncFileSystem

from ... import env
from ...errors import StoreError

INTERACTIVE = "hsstore_interactive"  # the option that asks ``storage.resolve`` for interactive retries (not passed on)


def metadata_concurrency() -> int:
    """Requests in flight for small-object reads (``env.METADATA_CONCURRENCY``): latency, not bandwidth, is what
    commit records and index segments cost, so many at once; s3fs's connection pool is raised to match."""
    return env.METADATA_CONCURRENCY.get()


def protocol_of(fs) -> str:
    """The first protocol name ``fs`` answers to (``file``, ``s3``, ``http`` ...)."""
    return fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]


def scheme_of(url: str) -> str | None:
    """The scheme of ``url`` (``s3`` of ``s3://b/k``); None for a plain path."""
    scheme, sep, _ = url.partition("://")
    return scheme if sep else None


def whole_sizes(paths: list[str], sizes: list[int | None] | None) -> list[int]:
    """The size of each whole object ``paths`` is read at, as a record or a listing gives it: a store's bytes are
    read only as far as is expected, so an object without one is refused here (``ValueError`` naming it), never
    read to whatever end its storage has."""
    given = list(sizes) if sizes is not None and len(sizes) == len(paths) else [None] * len(paths)
    unsized = [p for p, n in zip(paths, given) if n is None]
    if unsized:
        raise ValueError(f"{unsized[0]!r}: a whole object is read only at the size its record or listing gives "
                         "(none given); an unbounded read is refused")
    return [int(n) for n in given]


class Backend:
    """A filesystem fsspec knows and no registered backend claims: fsspec's calls, each bounded only by what it
    is asked for. Subclasses override what their kind does otherwise."""

    name = "fsspec"
    protocols: tuple[str, ...] = ()  # the URL schemes (and fsspec protocols) this backend serves
    writable = True  # the write side works (an HTTP server is read only)
    local_paths = False  # objects are regular files at local paths: the door opens them beneath their root
    lists_sizes = True  # a listing gives each object's size (an HTML index page does not)

    # -- which filesystems and URLs ---------------------------------------------------------------------------
    def matches(self, fs) -> bool:
        return protocol_of(fs) in self.protocols

    def matches_url(self, url: str) -> bool:
        return scheme_of(url) in self.protocols

    def options(self, options: dict[str, Any]) -> dict[str, Any]:
        """``options`` plus this backend's defaults, each only where the user did not set it."""
        return options

    def interactive(self, options: dict[str, Any]) -> dict[str, Any]:
        """``options`` for a command a person waits for (answers in seconds or fails saying why)."""
        return options

    def opened(self, fs, interactive: bool) -> None:
        """What this backend sets on a filesystem just opened (``storage.resolve``) that no storage option sets;
        ``interactive``: for a command a person waits for (``interactive`` marked its options)."""

    # -- the read side --------------------------------------------------------------------------------------
    def get_ranges(self, fs, paths: list[str], starts: list, ends: list, sizes: list | None = None,
                   concurrency: int = 64) -> list[Any]:
        """Bytes ``starts[i]:ends[i]`` of each object (None, None: the whole object, whose size ``sizes`` gives
        where known), or the exception that stopped one read, in order."""
        return fs.cat_ranges(paths, starts, ends, on_error="return")

    def get(self, fs, path: str, start: int, end: int, size: int | None = None) -> bytes:
        """One ranged GET (``get_ranges``), its failure raised."""
        (out,) = self.get_ranges(fs, [path], [start], [end], [size], 1)
        if isinstance(out, Exception):
            raise out
        return out

    def read_objects(self, fs, paths: list[str], sizes: list[int], concurrency: int) -> list[Any]:
        """Whole objects of ``sizes`` (each one's, from a record or listing: one ranged GET of exactly that many
        bytes; none given is refused, ``whole_sizes``), or the exception that stopped one, in order; concurrent
        where the filesystem is."""
        sizes = whole_sizes(paths, sizes)
        starts = [0 if n else None for n in sizes]
        ends = [n if n else None for n in sizes]  # an empty object takes no Range
        kw = {"batch_size": concurrency} if isinstance(fs, AsyncFileSystem) else {}
        return fs.cat_ranges(paths, starts, ends, on_error="return", **kw)

    def fill(self, fs, views: dict[str, list[memoryview]], concurrency: int) -> dict[str, int | Exception]:
        """path -> bytes of the object written into its ``views`` in turn (more than they hold when the object
        is larger: the caller names it), or the exception that stopped the read."""
        from ..receive import scatter

        paths = list(views)
        blobs = self.read_objects(fs, paths, [sum(len(v) for v in vs) for vs in views.values()], concurrency)
        return {p: (b if isinstance(b, Exception) else scatter(b, views[p])) for p, b in zip(paths, blobs)}

    @contextlib.contextmanager
    def open_ranged(self, fs, path: str, size: int) -> Iterator[Any]:
        """A binary file over object ``path`` of ``size`` bytes, for one pass; its ``size`` attribute, where it
        has one, is what the storage says (the door compares it)."""
        with fs.open(path, "rb") as f:
            yield f

    def size(self, fs, path: str) -> int | None:
        """The object's size as the storage declares it, without reading it (None: it declares none)."""
        n = fs.info(path).get("size")
        return None if n is None else int(n)

    def list_detail(self, fs, path: str, splits: list[str] | None = None, concurrency: int = 1
                    ) -> dict[str, dict[str, Any]]:
        """Base name -> listing entry (name, size, a stamp's field) of the objects directly under ``path``, fresh
        (never a listings cache), empty when there is none. ``splits``: base names that cut the key space, for
        a backend that lists ranges concurrently (``concurrency`` at once); the listing is the same either way."""
        try:
            entries = fs.ls(path, detail=True, refresh=True)
        except FileNotFoundError:
            return {}
        return {e["name"].rstrip("/").rsplit("/", 1)[-1]: e for e in entries if e.get("type") != "directory"}

    def list_names(self, fs, path: str) -> list[str]:
        """Base names of everything directly under ``path``, folders included."""
        try:
            return [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False, refresh=True)]
        except FileNotFoundError:
            return []

    def entries(self, fs, path: str) -> dict[str, bool]:
        """Name -> whether it is a folder, of everything directly under ``path`` (a destination's look before it
        is written). ``FileNotFoundError``: nothing there; ``NotADirectoryError``: a file there."""
        return {e["name"].rstrip("/").rsplit("/", 1)[-1]: e.get("type") == "directory"
                for e in fs.ls(path, detail=True, refresh=True)}

    # -- the write side ---------------------------------------------------------------------------------------
    def put_atomic(self, fs, path: str, data: bytes, root: str | None = None) -> dict[str, Any] | None:
        """Write a small object that readers see all of or none of; the written object's listing entry (what
        its stamp is read from), or None when the storage does not tell. ``root``: the store's folder."""
        response = fs.pipe_file(path, data)
        return response if isinstance(response, dict) else None

    def put_many(self, fs, objects: dict[str, Any], root: str | None = None) -> None:
        """Write many objects (``bytes``, or something with ``parts()`` / ``tobytes()``), concurrently where the
        filesystem is."""
        fs.pipe({p: d.tobytes() if hasattr(d, "tobytes") and not isinstance(d, bytes) else d
                 for p, d in objects.items()})

    def create_exclusive(self, fs, path: str, data: bytes, root: str | None = None) -> bool:
        """Create a small object only when nothing is at ``path`` (False: something is), as a conditional PUT
        (``If-None-Match: *``); a filesystem that cannot say so raises ``StoreError`` rather than guess."""
        try:
            fs.pipe_file(path, data, mode="create")
        except FileExistsError:
            return False
        except TypeError:  # a filesystem without exclusive creation
            raise StoreError(f"{type(fs).__name__} cannot create {path!r} exclusively (no conditional PUT): a job "
                             "lock needs it") from None
        except Exception as e:
            if "PreconditionFailed" in f"{type(e).__name__} {e}" or "412" in str(e):
                return False
            raise
        return True

    def delete(self, fs, path: str, root: str | None = None) -> None:
        """Remove one object hsstore wrote (a lock, a takeover marker). ``root``: the store's folder (local disk
        follows no link below it)."""
        fs.rm_file(path)


class ReadOnly(Backend):
    """A backend without a write side: every write refused in one line, nothing written."""

    writable = False

    def _refuse(self, path: str) -> StoreError:
        return StoreError(f"{path!r}: {self.name} storage is read only (nothing was written)")

    def put_atomic(self, fs, path: str, data: bytes, root: str | None = None) -> dict[str, Any] | None:
        raise self._refuse(path)

    def put_many(self, fs, objects: dict[str, Any], root: str | None = None) -> None:
        raise self._refuse(next(iter(objects), ""))

    def create_exclusive(self, fs, path: str, data: bytes, root: str | None = None) -> bool:
        raise self._refuse(path)

    def delete(self, fs, path: str, root: str | None = None) -> None:
        raise self._refuse(path)


class Bounded(Backend):
    """A remote backend whose every GET is ``receive``'s (``fetch``: an async GET of bytes ``start:end``, bounded
    by them and a deadline): ranges, whole objects of a known size and one streaming pass all made of such GETs."""

    @staticmethod
    async def fetch(fs, path: str, start: int, end: int, size: int | None = None) -> bytes:
        raise NotImplementedError

    def get_ranges(self, fs, paths: list[str], starts: list, ends: list, sizes: list | None = None,
                   concurrency: int = 64) -> list[Any]:
        from .. import receive

        return receive.gather(fs, self.fetch, paths, starts, ends, sizes, concurrency)

    def read_objects(self, fs, paths: list[str], sizes: list[int], concurrency: int) -> list[Any]:
        sizes = whole_sizes(paths, sizes)
        return self.get_ranges(fs, paths, [0] * len(paths), sizes, sizes, concurrency)

    @contextlib.contextmanager
    def open_ranged(self, fs, path: str, size: int) -> Iterator[Any]:
        """Bounded GETs of the listed size, block by block (never fsspec's file object)."""
        from .. import receive

        with receive.RangedFile(lambda start, end: self.get(fs, path, start, end, size), size) as f:
            yield f
