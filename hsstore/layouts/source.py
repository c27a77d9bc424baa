"""What a layout reads shards through: :class:`ShardSource`, the narrow seam between a ``Store`` and its layout.

``Store`` (store/reader.py) builds one when it opens and hands only it to its layout (layouts/base.py): the layout sees
this process's filesystem, the store root, the manifest, the chunk cache and a way to turn a shard name into
a checked location, and nothing else of the store (not its records, index or other readers' state). So a
new layout is written against six fields and a method, and the untrusted-store checks live in one place:
``locate`` refuses a shard name that is not one path part, a location of a shard merged by reference that
``names.location`` refused when the store was opened, and (local disk) a shard path that leaves the root
through a link. Checksums stay with the commit record, which the layout gets with each call.

The value is frozen; only its per-process part (the filesystem re-created after a fork, the checked names)
changes, and it is dropped when the value is pickled for a spawned DataLoader worker, as is the cache.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..format import names
from ..io import storage
from ..io.backends import backend_for
from ..io.backends.base import Backend
from .. import redaction
from ..format.commit import SHARDS_DIR
from ..errors import StoreError
from ..format.manifest import Manifest, canonical_json_hash

INHERITED: list = []  # filesystems a forked child inherited: kept alive for good, never used (see store/fork.py)


@dataclass
class _PerProcess:
    """The mutable part: valid in the process that made it only."""

    pid: int | None = None
    fs: Any = None
    located: dict = field(default_factory=dict)  # URL of a store holding shards merged by reference -> (fs, root)
    checked: set = field(default_factory=set)  # shard names whose name (and, locally, path) passed the checks


@dataclass(frozen=True)
class ShardSource:
    """Where one store's shards are read from, as a layout needs it (see the module doc).

    ``locations``: shard -> URL of the store holding its files (merged by reference), already allowed;
    ``refused``: shard -> why its location was refused (raised when the shard is read).
    ``chunk_cache``: a ``cache.ChunkCache`` that remote chunk reads go through, or None."""

    url: str
    root: str
    storage_options: Mapping[str, Any]
    manifest: Manifest
    locations: Mapping[str, str] = field(default_factory=dict)
    refused: Mapping[str, str] = field(default_factory=dict)
    chunk_cache: Any = None
    _proc: _PerProcess = field(default_factory=_PerProcess, compare=False, repr=False)

    @classmethod
    def opened(cls, url: str, fs, root: str, storage_options: Mapping[str, Any], manifest: Manifest,
               locations: Mapping[str, str], refused: Mapping[str, str]) -> "ShardSource":
        """A source for a store whose filesystem ``fs`` this process has just resolved."""
        return cls(url, root, dict(storage_options), manifest, dict(locations), dict(refused),
                   _proc=_PerProcess(os.getpid(), fs))

    def with_cache(self, chunk_cache) -> "ShardSource":
        """The same source reading remote chunks through ``chunk_cache`` (None: no cache)."""
        return dataclasses.replace(self, chunk_cache=chunk_cache)

    def _here(self) -> _PerProcess:
        p = self._proc
        if p.pid != os.getpid():  # a forked child must not reuse the parent's event loop: resolve anew
            INHERITED.extend(x for x in [p.fs, *(v[0] for v in p.located.values())] if x is not None)
            p.pid, p.fs, p.located = os.getpid(), storage.resolve(self.url, self.storage_options)[0], {}
        return p

    def filesystem(self):
        """This store's filesystem in this process (re-created after a fork)."""
        return self._here().fs

    def backend(self) -> Backend:
        """The storage backend of this store's filesystem (what it can do: ``local_paths``, ``get_ranges`` ...)."""
        return backend_for(self.filesystem())

    def __getattr__(self, name: str) -> Any:
        if name == "is_local":  # the storage kind is the backend's to know
            warnings.warn("ShardSource.is_local() is deprecated: use ShardSource.backend().local_paths",
                          DeprecationWarning, stacklevel=2)
            return lambda: self.backend().local_paths
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def locate(self, shard: str) -> tuple[Any, str, str]:
        """(filesystem, root, URL) holding ``shard``'s files: this store, or for a shard merged by reference
        the store its record's ``location`` names (same storage options). Raises ``StoreError`` for a shard
        name that is not one path part, a refused location, or (local disk) a shard path that resolves
        outside its root through a link."""
        p = self._here()
        if shard not in p.checked:
            where = f"store {self.url!r}"
            names.part(shard, "shard name", where)
            if shard in self.refused:
                raise StoreError(self.refused[shard])
            fs, root, _ = self._store_of(shard, p)
            if backend_for(fs).local_paths:
                for path in (f"{SHARDS_DIR}/{shard}", f"{SHARDS_DIR}/{shard}.tar"):
                    names.path(fs, root, path, "shard path", where)
            p.checked.add(shard)
        return self._store_of(shard, p)

    def _store_of(self, shard: str, p: _PerProcess) -> tuple[Any, str, str]:
        url = self.locations.get(shard)
        if url is None:
            return p.fs, self.root, self.url
        got = p.located.get(url)
        if got is None:
            got = p.located[url] = storage.resolve(url, self.storage_options)
        return got[0], got[1], url

    def cache_namespace(self) -> str:
        """Key of this store in a shared chunk cache: URL plus endpoint (secrets excluded)."""
        return canonical_json_hash({"url": self.url, "options": redaction.redact(dict(self.storage_options))})[:20]

    def __getstate__(self) -> dict:
        # for spawned DataLoader workers: the filesystem is resolved there on first use; a cache is per process
        return {**self.__dict__, "chunk_cache": None, "_proc": _PerProcess()}
