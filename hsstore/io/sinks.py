"""The write side of the door: local files written beneath a folder without following a link hsstore did not make.

A store folder, a run folder being resumed, a report's folder, a cache folder may hold links planted by whoever
else could write there (a store received from another team, a run folder in a shared place). A write that
followed one would overwrite or create a file elsewhere. So every local write of a store object, a run file, a
report or a cache copy is made here, one way:

- the folder the user named (``root``) is the user's and may itself be a link; every component below it is
  opened with ``O_NOFOLLOW`` beneath the one before (``openat``), made when missing, refused when a link;
- a file is written under a fresh temporary name created exclusively (``O_EXCL | O_NOFOLLOW``) and renamed
  over its name (the rename replaces a link there, never writes through it); an append opens with
  ``O_NOFOLLOW``; a file that must be new is created exclusively;
- a library that writes by path (safetensors) is given ``/proc/self/fd/N/name``, the checked folder itself.

A refusal is ``LinkRefused``, one line naming the link and what was being written.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import uuid
from typing import Any, Callable, Iterable, Iterator

from ..errors import StoreError

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class LinkRefused(StoreError, OSError):
    """A write that would go through a link hsstore did not make (or into something that is not a folder)."""


def _parts(rel: str) -> list[str]:
    parts = [p for p in rel.split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise LinkRefused(f"{rel!r}: a '.' or '..' part in a name hsstore writes")
    return parts


def _refuse(root: str, parts: list[str], i: int, what: str) -> LinkRefused:
    where = os.path.join(root, *parts[:i + 1])
    try:
        link = stat.S_ISLNK(os.lstat(where).st_mode)
    except OSError:
        link = False
    why = "is a symbolic link" if link else "is not a folder"
    return LinkRefused(f"{what}: {where} {why}; hsstore never writes through a link it did not make "
                       "(remove it, or give another folder); nothing was written there")


def open_folder(root: str | os.PathLike, rel: str = "", *, create: bool = True, what: str = "write",
                mode: int = 0o777) -> int:
    """A descriptor of folder ``root/rel``, each component below ``root`` opened without following a link and
    made (``mode``, before the umask) when missing and ``create``. ``FileNotFoundError`` when missing otherwise."""
    root = os.fspath(root)
    parts = _parts(rel)
    if create:
        os.makedirs(root or ".", exist_ok=True)  # the user's own folder: a link there is theirs
    fd = os.open(root or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for i, part in enumerate(parts):
            try:
                nfd = os.open(part, _DIR, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, mode, dir_fd=fd)
                try:
                    nfd = os.open(part, _DIR, dir_fd=fd)
                except OSError as e:
                    if e.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise _refuse(root, parts, i, what) from None
                    raise
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise _refuse(root, parts, i, what) from None
                raise
            os.close(fd)
            fd = nfd
        out, fd = fd, -1
        return out
    finally:
        if fd >= 0:
            os.close(fd)


def open_exact_folder(path: str | os.PathLike) -> int:
    """A descriptor of folder ``path`` itself, refused (``LinkRefused``) when it is a link or not a folder: for a
    folder that must be the one checked (the chunk cache's), not wherever a link there points."""
    try:
        return os.open(os.fspath(path), _DIR)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise LinkRefused(f"{os.fspath(path)}: a link or not a folder") from None
        raise


def _split(rel: str) -> tuple[str, str]:
    parts = _parts(rel)
    if not parts:
        raise LinkRefused(f"{rel!r}: not a file name")
    return "/".join(parts[:-1]), parts[-1]


def _write_closing(fd: int, data: Any, durable: bool) -> None:
    """``data`` (bytes, or a list of buffers in turn) written to ``fd``, synced when ``durable``; ``fd`` closed."""
    try:
        _write_all(fd, data if isinstance(data, list) else [data])
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, chunks: Iterable[Any]) -> None:
    with os.fdopen(fd, "wb", closefd=False) as f:
        for c in chunks:
            f.write(memoryview(c).cast("B") if not isinstance(c, (bytes, bytearray)) else c)
        f.flush()


@contextlib.contextmanager
def _in_place_of(root: str | os.PathLike, rel: str, what: str) -> Iterator[tuple[int, str, str]]:
    """(descriptor of ``rel``'s folder, a fresh temporary name there, that folder's path below ``root``): the caller
    writes the temporary file, which is then renamed over ``rel`` (a link there replaced, never followed), or removed
    when the write fails."""
    folder, name = _split(rel)
    dfd = open_folder(root, folder, what=what)
    tmp = f".tmp-{uuid.uuid4().hex}-{name}"
    try:
        yield dfd, tmp, folder
        os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dfd)
        raise
    finally:
        os.close(dfd)


def write_atomic(root: str | os.PathLike, rel: str, data: Any, *, what: str = "write", mode: int = 0o644,
                 durable: bool = True) -> os.stat_result:
    """File ``root/rel`` holding ``data`` (bytes, or a list of buffers written in turn) as a whole or not at all:
    written under a fresh exclusive temporary name, then renamed over ``rel`` (a link there is replaced, never
    followed). Returns the new file's ``lstat``."""
    with _in_place_of(root, rel, what) as (dfd, tmp, _):
        fd = os.open(tmp, _NEW, mode, dir_fd=dfd)
        _write_closing(fd, data, durable)
        st = os.stat(tmp, dir_fd=dfd, follow_symlinks=False)  # the same file once renamed
    return st


def write_file(root: str | os.PathLike, rel: str, data: Any, *, what: str = "write", mode: int = 0o644,
               durable: bool = True) -> None:
    """File ``root/rel`` (re)written in place with ``data`` (bytes, or a list of buffers written in turn): for
    names that are new to this writer (a shard's chunks); a link there is refused, not followed."""
    folder, name = _split(rel)
    dfd = open_folder(root, folder, what=what)
    try:
        try:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, mode,
                         dir_fd=dfd)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise _refuse(os.fspath(root), _parts(rel), len(_parts(rel)) - 1, what) from None
            raise
        _write_closing(fd, data, durable)
    finally:
        os.close(dfd)


def write_new(root: str | os.PathLike, rel: str, data: Any, *, what: str = "write", mode: int = 0o644,
              durable: bool = True) -> bool:
    """Create file ``root/rel`` holding ``data`` only when nothing (not even a link) is there: False when
    something is."""
    folder, name = _split(rel)
    dfd = open_folder(root, folder, what=what)
    try:
        try:
            fd = os.open(name, _NEW, mode, dir_fd=dfd)
        except FileExistsError:
            return False
        _write_closing(fd, data, durable)
        return True
    finally:
        os.close(dfd)


def open_append(root: str | os.PathLike, rel: str, *, what: str = "append to"):
    """File object appending to ``root/rel`` (created when missing); a link there is refused, not followed."""
    folder, name = _split(rel)
    dfd = open_folder(root, folder, what=what)
    try:
        try:
            fd = os.open(name, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                         dir_fd=dfd)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise LinkRefused(f"{what} {os.path.join(os.fspath(root), rel)}: a symbolic link; hsstore never "
                                  "writes through a link it did not make (nothing was written)") from None
            raise
    finally:
        os.close(dfd)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise LinkRefused(f"{what} {os.path.join(os.fspath(root), rel)}: not a regular file (nothing was written)")
    return os.fdopen(fd, "a", encoding="utf-8")


@contextlib.contextmanager
def folder_path(root: str | os.PathLike, rel: str = "", *, what: str = "write") -> Iterator[str]:
    """A path naming folder ``root/rel`` as ``open_folder`` checked it, for a library that writes by path
    (safetensors' ``save_file``): ``/proc/self/fd/N`` where the system has it, else the checked path."""
    dfd = open_folder(root, rel, what=what)
    try:
        proc = f"/proc/self/fd/{dfd}"
        yield proc if os.path.isdir(proc) else os.path.join(os.fspath(root), rel)
    finally:
        os.close(dfd)


def write_with(root: str | os.PathLike, rel: str, write: Callable[[str], None], *, what: str = "write",
               mode: int = 0o666) -> None:
    """File ``root/rel`` written by a library that writes by path (safetensors' ``save_file``): ``write(path)``
    is given a fresh temporary name it alone owns, made exclusively in the checked folder (mode ``mode`` before the
    umask), which is then renamed over ``rel`` (a link there is replaced, never written through)."""
    with _in_place_of(root, rel, what) as (dfd, tmp, folder):
        os.close(os.open(tmp, _NEW, mode, dir_fd=dfd))
        proc = f"/proc/self/fd/{dfd}"
        base = proc if os.path.isdir(proc) else os.path.join(os.fspath(root), folder)
        write(os.path.join(base, tmp))
        os.chmod(tmp, mode & ~umask(), dir_fd=dfd)  # the library may have made it owner-only


def umask() -> int:
    """This process's umask, read without changing it where Linux says it (``/proc/self/status``); elsewhere set
    and restored at once."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def remove_tree(root: str | os.PathLike, rel: str) -> None:
    """Remove ``root/rel`` -- a folder with everything in it, or a link or file in its place -- never following a
    link: a link is removed itself, not what it names."""
    import shutil

    folder, name = _split(rel)
    try:
        dfd = open_folder(root, folder, create=False)
    except FileNotFoundError:
        return
    try:
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(name, dir_fd=dfd)  # fd-based: links inside are removed, never followed
        else:
            os.unlink(name, dir_fd=dfd)
    finally:
        os.close(dfd)


def remove_file(root: str | os.PathLike, rel: str, *, what: str = "remove") -> None:
    """Remove the one file (or link, itself) ``root/rel``, each folder below ``root`` opened without following a
    link: a ``locks/`` planted as a link to another folder is refused, never emptied. ``FileNotFoundError`` when
    it is not there; a folder in its place is not removed (``IsADirectoryError``)."""
    folder, name = _split(rel)
    dfd = open_folder(root, folder, create=False, what=what)
    try:
        os.unlink(name, dir_fd=dfd)
    finally:
        os.close(dfd)


def is_link(path: str | os.PathLike) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(path).st_mode)
    except OSError:
        return False
