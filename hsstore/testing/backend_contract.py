"""The behaviour every storage backend owes (``hsstore/io/backends``), as one base class of tests: a backend's
test module subclasses ``BackendContract``, names its class (``backend_class``) and whether it is writable
(``writable``), and gives two fixtures:

- ``place``: a ``Place`` -- a filesystem and a root where the backend serves objects, and ``seed(key, data)``,
  which puts an object there by a way of its own (a file written into the served folder, the filesystem's own
  PUT), so the read side is tested without the write side;
- ``hostile``: ``make(kind)``, a context manager giving a ``Place`` whose object ``KEY`` (seeded with ``DATA``)
  misbehaves as ``kind`` says, or ``pytest.skip`` where the kind has no meaning for the backend (a local file
  has no transport to trickle). Kinds: ``declares_more`` (an answer that declares more bytes than asked),
  ``sends_more`` (a body past them), ``truncated`` (fewer bytes than the object's listed size), ``trickle`` (a
  body slower than the minimum rate), ``endless_listing`` (a listing of ``LISTING`` whose pages never end).

What is checked is what the door and the callers rely on: the registry picks the backend from its filesystem and
its URL; a ranged GET returns exactly the bytes asked for; a missing object is ``FileNotFoundError``; whole
objects of listed sizes (never without them), buffers filled, one streaming pass, a declared size; listings fresh, with sizes where the
backend says it lists them; and, through the door, whatever the transport does, an object is exactly its listed
size or refused (never served cut, padded or late: a cut body is the transport's
error). A writable backend's atomic put is read back with the stamp
its listing shows, create-if-absent creates once, delete removes; a read-only one refuses every write, in one
line, writing nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import pytest

from .. import env
from ..errors import CorruptionError, StoreError
from ..io import door, listing, receive, storage, transfer
from ..io.backends import backend_for, backend_for_url
from ..io.backends.base import Backend

KEY = "dir/object.bin"
DATA = bytes(range(256)) * 40 + b"tail"  # 10,244 bytes: not a power of two, every byte value
HOSTILE_KINDS = ("declares_more", "sends_more", "truncated", "trickle")
LISTING = "dir"  # the folder whose listing the ``endless_listing`` kind makes endless


@dataclass
class Place:
    """Where a backend serves objects: its filesystem, a root (no trailing slash), the URL of that root, and how a
    test puts an object there without the backend's write side."""

    fs: Any
    root: str
    url: str
    seed: Callable[[str, bytes], None]

    def path(self, key: str) -> str:
        return storage.join(self.root, key)

    @property
    def backend(self) -> Backend:
        return backend_for(self.fs)


class BackendContract:
    """Subclass with ``backend_class`` and the ``place`` and ``hostile`` fixtures (module docstring)."""

    backend_class: type[Backend] = Backend
    writable = True  # what the backend must say of itself: a read-only one must refuse every write

    @pytest.fixture
    def place(self) -> Place:
        raise NotImplementedError("a backend's contract test gives its place")

    @pytest.fixture
    def hostile(self) -> Callable[[str], ContextManager[Place]]:
        raise NotImplementedError("a backend's contract test gives its hostile places")

    # -- the registry -----------------------------------------------------------------------------------------
    def test_the_registry_chooses_this_backend_by_filesystem_and_url(self, place: Place):
        assert type(backend_for(place.fs)) is self.backend_class
        assert type(backend_for_url(place.url)) is self.backend_class
        assert backend_for(place.fs) is backend_for(place.fs)  # chosen once
        assert backend_for(place.fs).writable is self.writable

    # -- the read side ----------------------------------------------------------------------------------------
    def test_a_ranged_get_returns_exactly_the_bytes_asked_for(self, place: Place):
        place.seed(KEY, DATA)
        n = len(DATA)
        ranges = [(0, n), (3, 700), (n - 1, n), (5000, 5000 + 4096)]
        got = place.backend.get_ranges(place.fs, [place.path(KEY)] * len(ranges), [a for a, _ in ranges],
                                       [b for _, b in ranges], [n] * len(ranges), 4)
        assert got == [DATA[a:b] for a, b in ranges]
        assert place.backend.get(place.fs, place.path(KEY), 10, 20, n) == DATA[10:20]

    def test_a_missing_object_is_file_not_found(self, place: Place):
        place.seed(KEY, DATA)
        with pytest.raises(FileNotFoundError):
            place.backend.get(place.fs, place.path("dir/absent.bin"), 0, 10, 10)
        got = door.read_many(place.fs, place.root, ["dir/absent.bin"], sizes={"dir/absent.bin": 10}, bound=100)
        assert isinstance(got["dir/absent.bin"], FileNotFoundError)

    def test_whole_objects_of_listed_sizes_are_read_empty_ones_too(self, place: Place):
        place.seed(KEY, DATA)
        place.seed("dir/empty.bin", b"")
        paths = [place.path(KEY), place.path("dir/empty.bin")]
        assert place.backend.read_objects(place.fs, paths, [len(DATA), 0], 4) == [DATA, b""]
        assert transfer.cat_many(place.fs, paths, [len(DATA), 0]) == {paths[0]: DATA, paths[1]: b""}

    def test_a_whole_object_is_never_read_without_its_size(self, place: Place):
        """Every read of a store's bytes is bounded by what is expected: a whole object asked for without the size
        a record or listing gives is refused, naming it, before anything is read."""
        place.seed(KEY, DATA)
        path = place.path(KEY)
        for sizes in (None, [None], []):
            with pytest.raises(ValueError, match=f"{KEY}.*none given.*unbounded read is refused"):
                place.backend.read_objects(place.fs, [path], sizes, 4)
        with pytest.raises(ValueError, match=f"{KEY}.*none given"):
            transfer.cat_many(place.fs, [path], [None])

    def test_objects_fill_the_callers_buffers(self, place: Place):
        place.seed(KEY, DATA)
        first, second = bytearray(1000), bytearray(len(DATA) - 1000)
        views = {place.path(KEY): [memoryview(first), memoryview(second)]}
        assert place.backend.fill(place.fs, views, 2) == {place.path(KEY): len(DATA)}
        assert bytes(first + second) == DATA
        assert door.fill(place.fs, place.root, {KEY: [bytearray(len(DATA))]}) == {KEY: None}

    def test_one_streaming_pass_reads_the_object(self, place: Place):
        place.seed(KEY, DATA)
        with door.stream(place.fs, place.root, KEY, size=len(DATA)) as f:
            assert f.read(100) + f.read() == DATA

    def test_a_size_is_declared_without_reading(self, place: Place):
        place.seed(KEY, DATA)
        assert place.backend.size(place.fs, place.path(KEY)) == len(DATA)
        assert door.size_of(place.fs, place.root, KEY) == len(DATA)

    def test_listings_are_fresh_and_size_what_the_backend_says_they_size(self, place: Place):
        place.seed("dir/a.json", b"{}")
        place.seed("dir/sub/b.json", b"[]")
        assert listing.list_detail(place.fs, place.path("dir")).keys() == {"a.json"}
        place.seed("dir/c.json", b"123")  # a listing taken again sees what was added since
        got = listing.list_detail(place.fs, place.path("dir"))
        assert got.keys() == {"a.json", "c.json"}
        sizes = {k: e.get("size") for k, e in got.items()}
        assert sizes == ({"a.json": 2, "c.json": 3} if place.backend.lists_sizes else {"a.json": None, "c.json": None})
        assert listing.list_names(place.fs, place.path("dir")) == ["a.json", "c.json", "sub"]
        assert listing.list_detail(place.fs, place.path("nothing")) == {}
        assert listing.list_names(place.fs, place.path("nothing")) == []

    def test_a_listing_in_key_ranges_is_the_serial_listing(self, place: Place):
        for i in range(7):
            place.seed(f"dir/r{i}.json", b"x" * i)
        serial = listing.list_detail(place.fs, place.path("dir"))
        split = listing.list_detail_split(place.fs, place.path("dir"), ["r1.json", "r4.json", "r9.json"])
        assert {k: e.get("size") for k, e in split.items()} == {k: e.get("size") for k, e in serial.items()}
        assert len(serial) == 7

    def test_the_door_reads_an_object_within_its_bound_and_refuses_it_past(self, place: Place):
        place.seed(KEY, DATA)
        assert door.read(place.fs, place.root, KEY, bound=len(DATA)) == DATA
        with pytest.raises(door.Refused, match="bound"):
            door.read(place.fs, place.root, KEY, bound=len(DATA) - 1)
        got = door.read_many(place.fs, place.root, [KEY], sizes={KEY: len(DATA)}, bound=len(DATA))
        assert got == {KEY: DATA}

    # -- the transport: whatever it does, an object is its listed size or refused ------------------------------
    @pytest.mark.parametrize("kind", HOSTILE_KINDS)
    def test_a_hostile_answer_is_refused_never_served(self, hostile, kind, monkeypatch):
        monkeypatch.setenv(env.REQUEST_S.name, "1")  # a trickle is cut after a second, not ten
        with hostile(kind) as place:
            got = door.read_many(place.fs, place.root, [KEY], sizes={KEY: len(DATA)}, bound=len(DATA))[KEY]
            assert isinstance(got, Exception), f"{kind}: served {len(got)} bytes"
            if kind in ("declares_more", "sends_more"):
                assert isinstance(got, door.Refused), got  # one line naming the file and the bound
            elif kind == "trickle":
                assert isinstance(got, receive.DeadlineError), got

    def test_a_listing_that_never_ends_is_refused(self, hostile, monkeypatch):
        monkeypatch.setenv(env.REQUEST_S.name, "1")
        with hostile("endless_listing") as place:
            with pytest.raises(CorruptionError, match="refused"):
                listing.list_detail(place.fs, place.path(LISTING))

    # -- the write side ---------------------------------------------------------------------------------------
    def _writable(self, place: Place) -> None:
        if not self.writable:
            pytest.skip(f"{place.backend.name} storage is read only")

    def test_an_atomic_put_is_read_back_with_the_stamp_its_listing_shows(self, place: Place):
        self._writable(place)
        stamp = transfer.put_atomic(place.fs, place.path("w/manifest.json"), b'{"a": 1}', place.root)
        assert door.read(place.fs, place.root, "w/manifest.json", bound=100) == b'{"a": 1}'
        listed = listing.list_detail(place.fs, place.path("w"))["manifest.json"]
        assert stamp is None or stamp == listing.stamp(listed)
        transfer.put_atomic(place.fs, place.path("w/manifest.json"), b'{"a": 2}', place.root)  # replaced whole
        assert door.read(place.fs, place.root, "w/manifest.json", bound=100) == b'{"a": 2}'

    def test_many_objects_are_put_at_once(self, place: Place):
        self._writable(place)
        objects = {place.path(f"w/s/{i}.bin"): bytes([i]) * (i + 1) for i in range(5)}
        transfer.put_many(place.fs, objects, place.root)
        assert transfer.cat_many(place.fs, list(objects), [len(d) for d in objects.values()]) == objects

    def test_create_if_absent_creates_once_and_delete_removes_its_own(self, place: Place):
        self._writable(place)
        lock = place.path("locks/write.lock")
        assert place.backend.create_exclusive(place.fs, lock, b"first", place.root)
        assert not place.backend.create_exclusive(place.fs, lock, b"second", place.root)
        assert door.read(place.fs, place.root, "locks/write.lock", bound=10) == b"first"
        place.backend.delete(place.fs, lock, place.root)
        with pytest.raises(FileNotFoundError):
            door.read(place.fs, place.root, "locks/write.lock", bound=10)

    def test_a_read_only_backend_refuses_every_write_and_writes_nothing(self, place: Place):
        if self.writable:
            pytest.skip(f"{place.backend.name} storage is writable")
        place.seed(KEY, DATA)
        before = listing.list_names(place.fs, place.path("dir"))
        b, fs, p = place.backend, place.fs, place.path("dir/new.bin")
        for write in (lambda: b.put_atomic(fs, p, b"x", place.root), lambda: b.put_many(fs, {p: b"x"}, place.root),
                      lambda: b.create_exclusive(fs, p, b"x", place.root), lambda: b.delete(fs, place.path(KEY))):
            with pytest.raises(StoreError, match="read only"):
                write()
        assert listing.list_names(place.fs, place.path("dir")) == before

