"""Every shipped storage backend passes the backend contract (``hsstore/testing/backend_contract.py``): local disk
on a temporary folder, S3 on moto's server (the s3 tier), HTTP on a loopback server; the hostile answers come
from the hostile HTTP server and, for S3, the fault proxy in front of moto."""

from __future__ import annotations

import contextlib
import os
import uuid

import pytest

from hsstore.io import backends, storage
from hsstore.io.backends.base import ReadOnly
from hsstore.io.backends.http import HTTPBackend
from hsstore.io.backends.local import LocalBackend
from hsstore.io.backends.s3 import S3Backend
from hsstore.testing.backend_contract import DATA, KEY, LISTING, BackendContract, Place
from hsstore.testing.faultproxy import FaultProxy
from hsstore.testing.hostile_http import HostileHTTPServer


def _write(folder: str, key: str, data: bytes) -> None:
    path = os.path.join(folder, key)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


class TestLocal(BackendContract):
    backend_class = LocalBackend

    @pytest.fixture
    def place(self, tmp_path) -> Place:
        root = str(tmp_path / "store")
        os.makedirs(root)
        fs, _ = storage.resolve(root)
        return Place(fs, root, root, lambda k, d: _write(root, k, d))

    @pytest.fixture
    def hostile(self, tmp_path):
        """Local files have no transport: an answer past or short of the listed size is a file of another size,
        and a trickle has no meaning."""
        @contextlib.contextmanager
        def make(kind: str):
            if kind in ("trickle", "endless_listing"):
                pytest.skip("a local file has no transport to trickle, a folder's listing no pages")
            root = str(tmp_path / "hostile")
            _write(root, KEY, DATA[:len(DATA) // 2] if kind == "truncated" else DATA + b"more")
            yield Place(storage.resolve(root)[0], root, root, lambda k, d: _write(root, k, d))

        return make


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One HTTP server for the module (a server's shutdown waits out its poll), a fresh folder under it per test."""
    with HostileHTTPServer(str(tmp_path_factory.mktemp("served"))) as srv:
        yield srv


HTTP_FAULTS = {"declares_more": "huge_length", "sends_more": "overrun", "truncated": "truncate", "trickle": "trickle",
               "endless_listing": "endless_index"}


class TestHTTP(BackendContract):
    backend_class = HTTPBackend
    writable = False

    @pytest.fixture
    def place(self, server) -> Place:
        name = f"store-{uuid.uuid4().hex[:8]}"
        folder = os.path.join(server.directory, name)
        os.makedirs(folder)
        fs, root = storage.resolve(f"{server.url}/{name}")
        return Place(fs, root, f"{server.url}/{name}", lambda k, d: _write(folder, k, d))

    @pytest.fixture
    def hostile(self, server):
        @contextlib.contextmanager
        def make(kind: str):
            name = f"hostile-{uuid.uuid4().hex[:8]}"
            _write(os.path.join(server.directory, name), KEY, DATA)
            fault, what = HTTP_FAULTS[kind], f"{LISTING}/" if kind == "endless_listing" else KEY
            server.faults = [(fault, lambda p: p.startswith(f"/{name}/") and p.endswith(what))]
            try:
                fs, root = storage.resolve(f"{server.url}/{name}")
                yield Place(fs, root, f"{server.url}/{name}", lambda k, d: None)
                assert server.injected[fault] >= 1
            finally:
                server.faults = []

        return make


S3_FAULTS = {"declares_more": "huge_length", "sends_more": "overrun", "truncated": "truncate", "trickle": "trickle",
             "endless_listing": "endless_list"}


class TestS3(BackendContract):
    backend_class = S3Backend

    @pytest.fixture
    def place(self, s3_store) -> Place:
        url, opts = s3_store
        fs, root = storage.resolve(url, opts)
        return Place(fs, root, url, lambda k, d: fs.pipe_file(storage.join(root, k), d))

    @pytest.fixture
    def hostile(self, s3_store):
        url, opts = s3_store
        fs, root = storage.resolve(url, opts)
        fs.pipe_file(storage.join(root, KEY), DATA)

        @contextlib.contextmanager
        def make(kind: str):
            listed = kind == "endless_listing"
            with FaultProxy(opts["endpoint_url"], faults=[S3_FAULTS[kind]], persistent=True,
                            match=lambda m, p: m == "GET" and ("list-type=2" in p if listed
                                                               else p.split("?")[0].endswith(KEY))) as proxy:
                hostile_fs, _ = storage.resolve(url, {**opts, "endpoint_url": proxy.url})
                yield Place(hostile_fs, root, url, lambda k, d: None)
                assert proxy.injected[S3_FAULTS[kind]] >= 1

        return make



# -- adding a backend: one class (in hsstore, a module of io/backends/ and a line in BACKENDS) and this subclass
class ReadOnlyMemory(ReadOnly):
    """fsspec's in-memory filesystem, read only: fsspec's calls for the read side, every write refused."""

    name = "memory"
    protocols = ("memory",)


class TestReadOnlyMemory(BackendContract):
    backend_class = ReadOnlyMemory
    writable = False

    @pytest.fixture(autouse=True)
    def registered(self):
        backend = ReadOnlyMemory()
        backends.register(backend)
        yield
        backends.unregister(backend)

    @pytest.fixture
    def place(self) -> Place:
        fs, root = storage.resolve(f"memory://contract-{uuid.uuid4().hex[:8]}")
        return Place(fs, root, f"memory://{root.lstrip('/')}", lambda k, d: fs.pipe_file(storage.join(root, k), d))

    @pytest.fixture
    def hostile(self, place: Place):
        """No transport to declare, send or trickle anything: only an object cut short of its listed size."""
        @contextlib.contextmanager
        def make(kind: str):
            if kind != "truncated":  # (no transport: nothing to declare, send, trickle or page)
                pytest.skip("an in-memory object has no transport that could send more or trickle")
            place.seed(KEY, DATA[:len(DATA) // 2])
            yield place

        return make

def test_the_old_kind_names_warn_and_answer_as_the_backend_does(tmp_path):
    """``storage.is_local`` and ``ShardSource.is_local()`` moved to the backend (``backend_for(fs).local_paths``,
    ``ShardSource.backend()``): the old names still answer, with a DeprecationWarning naming the new one."""
    import fsspec

    import hsstore
    from hsstore.testing.stores import make_manifest, make_samples, write_samples

    with pytest.warns(DeprecationWarning, match="local_paths"):
        is_local = storage.is_local
    assert is_local(storage.resolve(str(tmp_path))[0]) and not is_local(fsspec.filesystem("memory"))
    url = str(tmp_path / "store")
    write_samples(url, make_manifest(), make_samples(2, max_len=40))
    source = hsstore.open(url).source
    with pytest.warns(DeprecationWarning, match=r"backend\(\)\.local_paths"):
        assert source.is_local() is True
    assert type(source.backend()) is LocalBackend
    with pytest.raises(AttributeError):
        source.no_such_name
