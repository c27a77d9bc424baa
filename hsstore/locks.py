"""A thread lock that a forked child receives unlocked.

A DataLoader with the ``fork`` context copies the parent's memory while the parent's read-ahead threads may be
inside a lock (the records' lock while a block of commit records is decompressed, the chunk cache's while it
scans its folder). The child's copy of that lock then stays locked for good and its first read waits forever. Every lock the read path shares between threads is a
``ProcessLock``: after a fork the child's copies are fresh locks (``os.register_at_fork``), as the standard
library does for ``logging``'s handler locks. What a parent thread was doing at fork time is not resumed in the
child; the state each lock guards is a cache the child reads again.
"""

from __future__ import annotations

import os
import threading
import weakref

_ALL: "weakref.WeakSet[ProcessLock]" = weakref.WeakSet()


class ProcessLock:
    """``threading.Lock`` for one process (a context manager, like it); a forked child's copy starts unlocked."""

    __slots__ = ("_lock", "__weakref__")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        _ALL.add(self)

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> "ProcessLock":
        self._lock.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def _renew(self) -> None:
        self._lock = threading.Lock()

    def __reduce__(self):  # pickled (a spawned worker's copy of an object): a fresh lock there
        return (ProcessLock, ())


def _renew_all() -> None:
    for lock in list(_ALL):
        lock._renew()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_renew_all)
