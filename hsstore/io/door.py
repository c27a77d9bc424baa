"""The one door through which hsstore reads a store's bytes (docs/FORMAT.md, "Limits").

A store from another team is untrusted: not only its names (``format/names.py``) but the files behind them. A
``manifest.json`` that is a link to ``/dev/zero`` must not be read until memory runs out, a chunk that is a FIFO
must not hang a command, a chunk linked to a copy outside the store must not be served as the store's. So every
read of a store object -- fixed names (manifest, commit records, the asset index, index segments, locks) as
well as chunks, tars and assets -- comes through here, and is opened one way:

- the key is a relative key under the root it belongs to (``key_problem``);
- on local disk each path component is opened beneath the root with ``O_NOFOLLOW`` (``openat``): a link
  anywhere inside the store is refused, never followed (the root itself is the user's and may be a link);
- the file must be a regular file (``fstat`` of the opened descriptor; a FIFO is opened non-blocking and
  refused before any read);
- a size bound is known before reading: the size a commit record or a listing gives, or a fixed cap for
  small JSON objects (``JSON_CAP``); a larger object is refused without reading it. Object stores get the
  same: the listed or recorded size, one ranged GET of exactly that size, or a GET capped at the bound;
- a remote object whose first bytes say what it is and how long it is (an index segment: ``read_many``'s
  ``check_head``) is asked for its head first when large: junk, or a length that differs from the listing's, is
  refused after ``HEAD_BYTES`` instead of after all of it has arrived at whatever rate its server keeps to.

A refusal is ``Refused`` (a ``CorruptionError``) whose one line names the file and why. JSON from a store is
parsed with a size and depth limit (``load_json``). ``tests/test_architecture.py`` checks that no module but
this one and ``storage`` reads store objects itself.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
from typing import Any, Callable, Iterator

from . import receive, storage, transfer
from .backends import backend_for
from ..errors import CorruptionError
from .memory import pread_into

JSON_CAP = 1 << 20  # a manifest, the asset index, a lock, a zarr.json: small objects read whole
RECORD_CAP = 256 << 20  # one commit record (a 1e4-sample shard's is a few MB)
SEGMENT_CAP = 4 << 30  # a zarr object whose record is not at hand (verify without a manifest)
INDEX_SEGMENT_CAP = 512 << 20  # one index segment (version 2: ~1.5 KB a record at 27B scale, 1e5 shards ~150 MB)
INDEX_TOTAL_CAP = 1 << 30  # every segment listed, together: over it the index is ignored, records read
ASSET_CAP = 16 << 30  # one tensor asset (an embedding of 248K x 5120 bf16 is 2.5 GB)
TOKENIZER_ASSET_CAP = 256 << 20  # one tokenizer file (Qwen's tokenizer.json is ~11 MB)
OTHER_ASSET_CAP = 16 << 20  # any other asset (config.json: a few kB)
JSON_DEPTH = 64  # nesting deeper than any object hsstore writes (the manifest's ``extra`` included)
HEAD_BYTES = 1 << 20  # a remote object larger than this with a ``check_head``: its head is read and checked first

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# non-blocking: a FIFO opens at once (and is then refused), instead of waiting for a writer forever
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0)


class Refused(CorruptionError):
    """A store object the door will not read: a link, not a regular file, larger than its bound, an unsafe
    key. ``key`` and ``why`` are kept apart, for ``verify``'s report."""

    def __init__(self, where: str, key: str, why: str) -> None:
        super().__init__(f"{where + ', ' if where else ''}file {key}: refused ({why})")
        self.key, self.why = key, why


class WrongSize(Refused):
    """An object of another size than its record lists: truncated or rewritten (data damage, said as such)."""


def percent_decoded(name: str) -> str:
    """``name`` percent-decoded until nothing changes (at most a few rounds: ``%252e`` is ``%2e`` is ``.``): what an
    HTTP server or a URL library may make of it before it reaches a path."""
    from urllib.parse import unquote

    for _ in range(4):
        got = unquote(name)
        if got == name:
            break
        name = got
    return name


def _part_problem(name: str) -> str | None:
    if "\\" in name or "\x00" in name:
        return "backslash or NUL in a name"
    if name.startswith("/"):
        return "an absolute name"
    parts = name.split("/")
    if "" in parts:
        return "an empty path part"
    if "." in parts or ".." in parts:
        return "a '.' or '..' part"
    return None


def key_problem(name: Any) -> str | None:
    """Why ``name`` is not a relative key ``a/b/c`` under a root (None: it is): empty, not a string, absolute,
    ``.``/``..`` or empty parts, backslashes and NUL are refused (an S3 key ``assets/../../x`` is just a key,
    but a path joined with it is not under the root), and so are keys whose percent-decoded form has any of
    these (``%2e%2e/``: an HTTP server decodes it into ``../``)."""
    if not isinstance(name, str) or not name:
        return "empty or not a string"
    why = _part_problem(name)
    if why is None and "%" in name:
        why = _part_problem(percent_decoded(name))
        if why is not None:
            why = f"percent-encoded: {why} once decoded"
    return why


def _checked_key(key: str, where: str) -> str:
    why = key_problem(key)
    if why:
        raise Refused(where, repr(key), why)
    return key


# -- local files --------------------------------------------------------------------------------------------
def _explain(err: OSError, dir_fd: int, name: str) -> str | None:
    """Why an ``openat`` with ``O_NOFOLLOW`` failed in words, when it was the door's own refusal (a link,
    a file where a folder was expected); None for an ordinary error (missing, permission)."""
    if err.errno not in (errno.ELOOP, errno.ENOTDIR):
        return None
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return None
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link (links in a store or a folder from elsewhere are never followed)"
    return "not a folder" if err.errno == errno.ENOTDIR else None


def _kind(mode: int) -> str:
    for test, what in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a device"),
                       (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return what
    return "not a regular file"


def open_beneath(root: str, key: str, where: str = "") -> tuple[int, os.stat_result]:
    """(descriptor, its ``fstat``) of regular file ``key`` under local folder ``root``, every component opened
    beneath the previous one without following a link. ``FileNotFoundError`` when it does not exist."""
    _checked_key(key, where)
    parts = key.split("/")
    fd = os.open(root or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            try:
                nfd = os.open(part, _FILE_FLAGS if last else _DIR_FLAGS, dir_fd=fd)
            except OSError as e:
                why = _explain(e, fd, part)
                if why:
                    raise Refused(where, key, why if last else f"{'/'.join(parts[:i + 1])} is {why}") from None
                if e.errno == errno.ENOTDIR:
                    raise FileNotFoundError(errno.ENOENT, "no such file", key) from None
                raise
            os.close(fd)
            fd = nfd
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Refused(where, key, f"{_kind(st.st_mode)}, not a regular file")
        out, fd = fd, -1
        return out, st
    finally:
        if fd >= 0:
            os.close(fd)


@contextlib.contextmanager
def opened(root: str, key: str, *, size: int | None = None, bound: int | None = None,
           where: str = "") -> Iterator[tuple[int, int]]:
    """``(descriptor, size)`` of local file ``key`` under ``root`` (``open_beneath``), refused when its size is
    not ``size`` (what the record lists) or exceeds ``bound``; closed on exit."""
    fd, st = open_beneath(root, key, where)
    try:
        _check_size(st.st_size, size, bound, key, where)
        yield fd, st.st_size
    finally:
        os.close(fd)


def _check_size(n: int, size: int | None, bound: int | None, key: str, where: str) -> None:
    if size is not None and n != size:
        raise WrongSize(where, key, f"size {n} != committed {size} (truncated or rewritten)")
    if bound is not None and n > bound:
        raise Refused(where, key, f"{n:,} bytes, larger than its bound of {bound:,}")


def _read_fd(fd: int, n: int, key: str, where: str) -> bytes:
    buf = bytearray(n)
    got = pread_into(fd, [buf], 0) if n else 0
    if got != n:
        raise Refused(where, key, f"ended after {got:,} of {n:,} bytes (changed while read)")
    return bytes(buf)


# -- any filesystem -----------------------------------------------------------------------------------------
def read(fs, root: str, key: str, *, bound: int, size: int | None = None, where: str = "") -> bytes:
    """The whole object ``key`` under ``root``: at most ``bound`` bytes, exactly ``size`` when given (a record's
    or a listing's). ``FileNotFoundError`` when it does not exist; ``Refused`` for the door's refusals."""
    _checked_key(key, where)
    if size is not None:
        _check_size(size, None, bound, key, where)
    backend = backend_for(fs)
    if backend.local_paths:
        with opened(root, key, size=size, bound=bound, where=where) as (fd, n):
            return _read_fd(fd, n, key, where)
    path = storage.join(root, key)
    if size is None and bound > receive.UNDECLARED_CAP and not backend.lists_sizes:  # a listing gave no size
        size, bound = _undeclared(fs, root, key, bound, where)
    if size is not None:
        data = transfer.cat_many(fs, [path], [size])[path]
    else:  # one GET of at most bound + 1 bytes: a larger object is refused without fetching it all
        try:
            data = backend.get(fs, path, 0, bound + 1)
        except FileNotFoundError:
            raise
        except receive.AnswerRefused as e:
            raise Refused(where, key, e.why) from None
        except OSError as e:
            if "InvalidRange" in str(e) or "416" in str(e):  # an empty object has no byte 0
                data = b""
            else:
                raise
    if isinstance(data, receive.AnswerRefused):
        raise Refused(where, key, data.why)
    if isinstance(data, Exception):
        raise data
    _check_size(len(data), size, bound, key, where)
    return data


def declared_size(fs, root: str, key: str, *, bound: int, where: str = "") -> int | None:
    """The length the storage declares for object ``key`` without reading it (an HTTP server's HEAD; None: it
    declares none), within ``bound`` (``Refused`` past it): the size an object a listing gives none for is read
    as."""
    try:
        declared = backend_for(fs).size(fs, storage.join(root, key))
    except receive.AnswerRefused as e:
        raise Refused(where, key, e.why) from None
    if declared is not None:
        _check_size(declared, None, bound, key, where)
    return declared


def _undeclared(fs, root: str, key: str, bound: int, where: str) -> tuple[int | None, int]:
    """(size, bound) an object a listing gives no size for is read at: the length its storage declares (one HEAD,
    ``declared_size``) within ``bound``, or, where it declares none, no size and the bound cut to
    ``receive.UNDECLARED_CAP`` (a body without a declared end is read only that far). Asked once an object: a
    bound within the cap asks nothing more of ``read``."""
    size = declared_size(fs, root, key, bound=bound, where=where)
    return size, bound if size is not None else min(bound, receive.UNDECLARED_CAP)


def _head_refusal(fs, root: str, key: str, size: int | None, bound: int, check: Callable[[str, bytes, int], None],
                  where: str) -> tuple[int | None, int, Exception | None]:
    """(the object's size, its bound, why it is refused on its first ``HEAD_BYTES`` or None) for a remote object of
    ``size`` bytes within ``bound`` (None: an HTTP listing's, asked of its server's HEAD: ``_undeclared``):
    ``check(key, head, size)`` raising refuses it, and nothing more is asked for it."""
    try:
        if size is None and not backend_for(fs).lists_sizes:
            size, bound = _undeclared(fs, root, key, bound, where)
        if size is None or size <= HEAD_BYTES:
            return size, bound, None
        (head,) = read_ranges(fs, root, key, [(0, HEAD_BYTES)], size=size, where=where)
        if isinstance(head, Exception):
            raise head
        check(key, head, size)
    except (OSError, CorruptionError) as e:
        return size, bound, Refused(where, key, e.why) if isinstance(e, receive.AnswerRefused) else e
    return size, bound, None


def read_many(fs, root: str, keys: list[str], *, sizes: dict[str, int | None], bound: Callable[[str], int] | int,
              ok: Callable[[str, bytes], bool] | None = None, where: str = "",
              check_head: Callable[[str, bytes, int], None] | None = None) -> dict[str, Any]:
    """Objects ``keys`` under ``root``, each exactly the size ``sizes`` lists (a commit record's, a listing's;
    None: unknown, as an HTTP listing may give) and within ``bound`` (a number, or a function of the key): key ->
    bytes, or the exception that stopped it (``FileNotFoundError``, ``Refused``, a failed request). Concurrent on
    object stores, where an object that arrives but fails ``ok(key, bytes)`` is fetched again
    (``transfer.cat_verified``). ``check_head(key, head, size)``: on object stores, an object over ``HEAD_BYTES``
    has its head read first and is refused (its exception kept) when that raises."""
    limit = bound if callable(bound) else (lambda _k, b=bound: b)
    local = backend_for(fs).local_paths
    out: dict[str, Any] = {}
    todo = []
    sizes = dict(sizes)
    bounds: dict[str, int] = {}  # each key's bound, cut where its storage declares no size (``_undeclared``)
    for k in keys:
        why = key_problem(k)
        if why:
            out[k] = Refused(where, repr(k), why)
            continue
        bounds[k] = limit(k)
        if sizes.get(k) is not None and sizes[k] > bounds[k]:
            out[k] = Refused(where, k, f"{sizes[k]:,} bytes listed, larger than its bound of {bounds[k]:,}")
            continue
        if check_head is not None and not local:
            sizes[k], bounds[k], refusal = _head_refusal(fs, root, k, sizes.get(k), bounds[k], check_head, where)
            if refusal is not None:
                out[k] = refusal
                continue
        todo.append(k)
    unsized = [k for k in todo if sizes.get(k) is None]
    if local or unsized:
        for k in todo if local else unsized:
            try:
                out[k] = read(fs, root, k, bound=bounds[k], size=sizes.get(k), where=where)
            except (OSError, CorruptionError) as e:
                out[k] = e
        if local:
            return out
    paths = {storage.join(root, k): k for k in todo if sizes.get(k) is not None}
    check = (lambda p, b: ok(paths[p], b)) if ok is not None else (lambda p, b: True)
    got = transfer.cat_verified(fs, list(paths), check, sizes={p: sizes[k] for p, k in paths.items()})
    for p, k in paths.items():
        data = got.get(p)
        if isinstance(data, (bytes, bytearray)) and len(data) != sizes[k]:
            data = WrongSize(where, k, f"size {len(data)} != committed {sizes[k]} (truncated or rewritten)")
        elif isinstance(data, receive.AnswerRefused):  # what the server sent or declared past the size: the door's refusal
            data = Refused(where, k, data.why)
        out[k] = data
    return out


def fill(fs, root: str, targets: dict[str, list[Any]], check: Callable[[str], str | None] | None = None,
         where: str = "") -> dict[str, Exception | str | None]:
    """Objects straight into the caller's buffers: object ``key`` fills ``targets[key]`` in turn, and must be
    exactly their size (``transfer.cat_into`` on object stores; ``preadv`` beneath the root locally). Returns
    key -> None (filled and passed ``check(key)``), what is wrong with the bytes, or the read's exception."""
    if not backend_for(fs).local_paths:
        by_path = {storage.join(root, k): k for k in targets}
        checked = (lambda p: check(by_path[p])) if check is not None else None
        got = transfer.cat_into(fs, {p: targets[k] for p, k in by_path.items()}, checked)
        return {by_path[p]: r for p, r in got.items()}
    out: dict[str, Exception | str | None] = {}
    for k, bufs in targets.items():
        want = sum(memoryview(b).nbytes for b in bufs)
        try:
            with opened(root, k, where=where) as (fd, n):
                if n != want:
                    out[k] = f"object is {n:,} bytes, expected {want:,}"
                    continue
                got = pread_into(fd, bufs, 0)
            out[k] = (f"object ended early ({got:,} of {want:,} bytes)" if got != want
                      else check(k) if check is not None else None)
        except (OSError, CorruptionError) as e:
            out[k] = e
    return out


def read_ranges(fs, root: str, key: str, ranges: list[tuple[int, int]], *, size: int, where: str = "") -> list[Any]:
    """Byte ranges ``[start, end)`` of object ``key`` of ``size`` bytes (a record's), each inside it: a list of
    bytes (or the exception of a failed range), in order. For object stores (local files: ``opened``)."""
    _checked_key(key, where)
    bad = [r for r in ranges if not 0 <= r[0] <= r[1] <= size]
    if bad:
        raise Refused(where, key, f"range {bad[0]} outside its {size:,} bytes")
    path = storage.join(root, key)
    return backend_for(fs).get_ranges(fs, [path] * len(ranges), [r[0] for r in ranges], [r[1] for r in ranges],
                                      [size] * len(ranges), storage.metadata_concurrency())


@contextlib.contextmanager
def stream(fs, root: str, key: str, *, size: int, where: str = "") -> Iterator[Any]:
    """A binary file object over object ``key`` of exactly ``size`` bytes (a record's), for one streaming pass
    (``verify`` of a tar): the size is checked before the first byte is read."""
    backend = backend_for(fs)
    if backend.local_paths:
        with opened(root, key, size=size, where=where) as (fd, _):
            with os.fdopen(os.dup(fd), "rb") as f:
                yield f
        return
    _checked_key(key, where)
    with backend.open_ranged(fs, storage.join(root, key), size) as f:  # object stores: bounded GETs, block by block
        n = getattr(f, "size", None)
        if n is not None:
            _check_size(int(n), size, None, key, where)
        yield f


def size_of(fs, root: str, key: str, where: str = "") -> int:
    """The size of object ``key`` (local: of the regular file beneath the root, ``Refused`` otherwise), without
    reading it."""
    backend = backend_for(fs)
    if backend.local_paths:
        with opened(root, key, where=where) as (_, n):
            return n
    n = backend.size(fs, storage.join(root, _checked_key(key, where)))
    if n is None:
        raise Refused(where, key, "its storage declares no size")
    return n


# -- JSON ---------------------------------------------------------------------------------------------------
def load_json(data: bytes | str, where: str, *, depth: int = JSON_DEPTH, error=CorruptionError) -> Any:
    """JSON from a store, nested at most ``depth`` deep; anything that does not parse (bad syntax, a number of
    thousands of digits, nesting past Python's recursion limit) is one ``error`` naming ``where``."""
    try:
        value = json.loads(data)
    except RecursionError:
        raise error(f"{where}: JSON nested too deep (more than {depth} levels)") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError; an integer past int's digit limit
        raise error(f"{where}: not valid JSON ({str(e)[:200]})") from None
    text = data.encode() if isinstance(data, str) else bytes(data)
    if text.count(b"[") + text.count(b"{") > depth and _depth(value) > depth:
        raise error(f"{where}: JSON nested too deep (more than {depth} levels)")
    return value


def _depth(value: Any) -> int:
    """How deep containers nest in ``value`` (0 for a scalar), without recursion."""
    best, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, dict):
            v = v.values()
        elif not isinstance(v, list):
            continue
        best = max(best, d)
        todo.extend((x, d + 1) for x in v if isinstance(x, (dict, list)))
    return best


def read_json(fs, root: str, key: str, *, where: str, bound: int = JSON_CAP, size: int | None = None,
              error=CorruptionError) -> Any:
    """``read`` + ``load_json``: a small JSON object of a store."""
    return load_json(read(fs, root, key, bound=bound, size=size, where=where), f"{where}" if where else key,
                     error=error)


# -- inputs that are not a store: drafter, checkpoint, run and peer folders, config files ------------------------
# They pass the same door: regular files only, a size bound before reading, JSON and YAML with depth and alias
# limits, no link out of the folder the user named (the folder itself, or a file the user named, may be a link).
YAML_CAP = 1 << 20  # a --config file or a run.yaml: settings, a few KB
YAML_NODES = 100_000  # nodes of a YAML document once its aliases are expanded (a run.yaml has a few hundred)
RUN_LOG_CAP = 512 << 20  # a run's metrics.jsonl or samples log (about 400 bytes a logged step)


def open_file(path: str | os.PathLike, where: str = "") -> tuple[int, os.stat_result]:
    """(descriptor, ``fstat``) of a regular file the user named (it may be a link, as the user's own); a FIFO, a
    device or a folder is refused before any read (``Refused``)."""
    fd = os.open(os.fspath(path), _FILE_FLAGS & ~os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Refused(where, os.fspath(path), f"{_kind(st.st_mode)}, not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_file(path: str | os.PathLike, *, bound: int, where: str = "") -> bytes:
    """The whole regular file the user named, at most ``bound`` bytes (larger: refused unread)."""
    fd, st = open_file(path, where)
    try:
        _check_size(st.st_size, None, bound, os.fspath(path), where)
        return _read_fd(fd, st.st_size, os.fspath(path), where)
    finally:
        os.close(fd)


def read_beneath(folder: str | os.PathLike, key: str, *, bound: int, where: str = "") -> bytes:
    """File ``key`` of a local folder from elsewhere (a drafter, a checkpoint, a run, a peer's files), opened
    beneath it without following a link; at most ``bound`` bytes."""
    with opened(os.fspath(folder), key, bound=bound, where=where) as (fd, n):
        return _read_fd(fd, n, key, where)


def read_json_beneath(folder: str | os.PathLike, key: str, *, bound: int = JSON_CAP, where: str = "",
                      error=ValueError) -> Any:
    """``read_beneath`` + ``load_json``: a JSON file of a folder from elsewhere (a drafter's config, a checkpoint's
    trainer state), refusals and bad JSON alike one ``error`` naming the file."""
    where = where or os.fspath(folder)
    try:
        data = read_beneath(folder, key, bound=bound, where=where)
    except Refused as e:
        raise error(str(e)) from None
    return load_json(data, os.path.join(os.fspath(folder), key), error=error)


def folder_beneath(root: str | os.PathLike, rel: str, where: str = "") -> str:
    """The path of folder ``rel`` below the local folder ``root`` the user named, refused (``Refused``) when a
    component below ``root`` is a link or not a folder: a folder from elsewhere (a run, a drafter, a peer's files)
    is read beneath the folder named, never through a link planted in it. ``FileNotFoundError`` when missing."""
    path = os.fspath(root)
    if not rel:
        return path
    _checked_key(rel, where)
    for part in rel.split("/"):
        path = os.path.join(path, part)
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            raise Refused(where, rel, f"{os.path.basename(path)} is a symbolic link (links in a folder from "
                                      "elsewhere are never followed)")
        if not stat.S_ISDIR(st.st_mode):
            what = "a file" if stat.S_ISREG(st.st_mode) else _kind(st.st_mode)
            raise Refused(where, rel, f"{os.path.basename(path)} is {what}, not a folder")
    return path


def check_tree(root: str | os.PathLike, rel: str, where: str = "") -> None:
    """Folder ``rel`` below ``root`` and everything in it, for a library that reads it by name (an experiment
    tracker's folder in a run from elsewhere): refused (``Refused``, naming the first) where a part is a link or
    neither a folder nor a regular file (a FIFO would hang the library, a link to ``/dev/zero`` fill its memory).
    Nothing is read; ``FileNotFoundError`` when the folder is not there."""
    top = folder_beneath(root, rel, where)
    for folder, subfolders, files in os.walk(top):
        for name in subfolders + files:
            path = os.path.join(folder, name)
            mode = os.lstat(path).st_mode
            key = os.path.relpath(path, os.fspath(root))
            if stat.S_ISLNK(mode):
                raise Refused(where, key, "a symbolic link (links in a folder from elsewhere are never followed)")
            if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
                raise Refused(where, key, f"{_kind(mode)}, not a regular file")


def is_file_beneath(folder: str | os.PathLike, key: str) -> bool:
    """Whether ``key`` under ``folder`` is there as anything at all without following a link (a link or a FIFO
    counts: reading it is refused then, naming it, rather than silently passed by)."""
    try:
        os.stat(os.path.join(os.fspath(folder), key), follow_symlinks=False)
    except OSError:
        return False
    return True


@contextlib.contextmanager
def path_beneath(folder: str | os.PathLike, key: str, *, bound: int | None = None,
                 where: str = "") -> Iterator[str]:
    """A path naming exactly the regular file ``key`` under ``folder`` as the door opened it, for a library that
    opens files by name (safetensors): ``/proc/self/fd/N`` where the system has it, so nothing swapped after
    the check is read; else the checked path."""
    with opened(os.fspath(folder), key, bound=bound, where=where) as (fd, _):
        proc = f"/proc/self/fd/{fd}"
        yield proc if os.path.exists(proc) else os.path.join(os.fspath(folder), key)


def load_yaml(data: bytes | str, where: str, *, depth: int = JSON_DEPTH, nodes: int = YAML_NODES,
              error=ValueError) -> Any:
    """YAML from a file the user did not write (a ``--config``, a ``run.yaml`` received): plain data only
    (``SafeLoader``: no tag builds an object), nested at most ``depth`` deep and at most ``nodes`` nodes once its
    aliases are expanded, both checked on the composed graph before anything is built (an alias bomb of a few
    hundred bytes expands to billions of nodes). Anything else is one ``error`` naming ``where``."""
    import yaml

    loader = None
    try:
        loader = yaml.SafeLoader(data)  # (it reads the first bytes: not UTF-8 is a YAMLError already)
        root = loader.get_single_node()
        if root is None:
            return None
        _check_yaml_graph(root, where, depth, nodes, error)
        return loader.construct_document(root)
    except RecursionError:
        raise error(f"{where}: YAML nested too deep (more than {depth} levels)") from None
    except yaml.YAMLError as e:
        raise error(f"{where}: not valid YAML ({(str(e).splitlines() or [''])[0][:200]})") from None
    finally:
        if loader is not None:
            loader.dispose()


def _check_yaml_graph(root, where: str, depth: int, nodes: int, error) -> None:
    """Nodes and depth of a composed YAML document as if its aliases were expanded, in one pass over its distinct
    nodes (an alias is the same node object again); a node that contains itself is refused."""
    import yaml

    def children(n) -> list:
        if isinstance(n, yaml.SequenceNode):
            return n.value
        if isinstance(n, yaml.MappingNode):
            return [x for pair in n.value for x in pair]
        return []

    size: dict[int, int] = {}
    deep: dict[int, int] = {}
    busy: set[int] = set()
    stack = [(root, False)]
    while stack:
        n, finished = stack.pop()
        i = id(n)
        if finished:
            kids = children(n)
            size[i] = 1 + sum(size[id(k)] for k in kids)
            deep[i] = 1 + max((deep[id(k)] for k in kids), default=0)
            busy.discard(i)
            if size[i] > nodes:
                raise error(f"{where}: YAML expands to more than {nodes:,} nodes (repeated aliases); refused")
            if deep[i] > depth + 1:
                raise error(f"{where}: YAML nested too deep (more than {depth} levels)")
            continue
        if i in size:
            continue
        if i in busy:
            raise error(f"{where}: YAML holds a node that contains itself (a recursive alias); refused")
        busy.add(i)
        stack.append((n, True))
        stack.extend((k, False) for k in children(n) if id(k) not in size)
