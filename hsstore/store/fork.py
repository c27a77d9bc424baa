"""The fork hooks every reader needs: a forked child (a DataLoader worker) keeps the parent's cached fsspec
filesystems referenced for good, so none is finalised there (installed once, when the reader is imported)."""

from __future__ import annotations

import gc
import os

import fsspec.spec

from ..layouts.source import INHERITED as _INHERITED


_HELD: list = []  # the parent's cached filesystems, referenced across a fork
_UNFREEZE_IN_PARENT = False  # whether the parent undoes this fork's gc.freeze() (nothing was frozen before)


def _hold_filesystems_across_fork() -> None:
    """Keep the parent's cached fsspec filesystems referenced in a forked child.

    fsspec empties its instance cache in the child; the dropped s3fs instances are then finalised there:
    their aiohttp sessions belong to the parent's event loop, and closing them logs "Unclosed client
    session" from a child, whose stderr lock may have been held by a parent thread at fork time. That
    deadlocked DataLoader workers. Holding the instances means no finaliser runs in the child; freezing
    the garbage collector's view does the same for the parent's not-yet-collected garbage (Python's own
    advice for fork without exec: ``gc.freeze()`` before forking).

    ``gc.unfreeze()`` thaws everything, so the parent undoes the freeze only when nothing was frozen
    before it: an application that froze its own objects (the same advice) keeps them frozen, and the
    objects of this fork stay frozen with them, as if the application had frozen right before forking.
    """
    global _UNFREEZE_IN_PARENT
    for cls in list(getattr(fsspec.spec, "_registered_classes", ())):
        _HELD.extend(getattr(cls, "_cache", {}).values())
    _UNFREEZE_IN_PARENT = gc.get_freeze_count() == 0
    gc.freeze()


def _release_in_parent() -> None:
    del _HELD[:]
    if _UNFREEZE_IN_PARENT:
        gc.unfreeze()


def _keep_in_child() -> None:
    _INHERITED.extend(_HELD)
    del _HELD[:]


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_hold_filesystems_across_fork, after_in_parent=_release_in_parent,
                        after_in_child=_keep_in_child)
