"""Shared fixtures: a real S3 endpoint on loopback (moto's server, as s3fs's own tests do) and
small synthetic stores (``hsstore.testing.stores``, whose helpers tests also import from here); the test tiers."""

from __future__ import annotations

import contextlib
import inspect
import json
import types
import uuid
from pathlib import Path

import pytest

from hsstore import env

env.passive_openmp()  # before torch loads, as the command line does: idle OpenMP threads sleep, never spin

from hsstore.format.manifest import Manifest  # noqa: E402
from hsstore.io import backends  # noqa: E402
from hsstore.io.backends.base import Backend  # noqa: E402
from hsstore.io.backends.s3 import S3Backend  # noqa: E402
from hsstore.testing.ports import free_port  # noqa: E402
from hsstore.testing.stores import make_manifest, make_samples, write_samples  # noqa: F401  (tests import them here)


# the patience below as storage options, for spawned DataLoader workers and ranks: a fresh interpreter has s3fs's
# 5 s connect timeout back (the class attribute is patched in this process only)
PATIENT_S3 = {"config_kwargs": {"connect_timeout": 60}}


@pytest.fixture(scope="session")
def s3_endpoint():
    """URL of a moto S3 server on 127.0.0.1, with dummy credentials in the environment."""
    from moto.server import ThreadedMotoServer

    mp = pytest.MonkeyPatch()
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing-secret",
                 "AWS_DEFAULT_REGION": "us-east-1"}.items():
        mp.setenv(k, v)
    mp.delenv("AWS_PROFILE", raising=False)
    # moto answers from a thread of the test process: on a loaded 2-core machine it can take longer than s3fs's
    # 5 s to accept a connection, which a real endpoint would not
    import s3fs

    mp.setattr(s3fs.S3FileSystem, "connect_timeout", 60)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()
    mp.undo()


@pytest.fixture
def s3_store(s3_endpoint):
    """(url, storage_options) of an empty prefix in a fresh bucket on the loopback S3 endpoint."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    bucket = f"hs-{uuid.uuid4().hex[:10]}"
    fs = s3fs.S3FileSystem(endpoint_url=s3_endpoint)
    fs.mkdir(bucket)
    yield f"s3://{bucket}/stores/a", {"endpoint_url": s3_endpoint}


class WholeObjectS3(S3Backend):
    """S3 filled as the protocol's default ``fill`` fills any backend that does not stream: each object fetched
    whole as bytes (S3's bounded GETs), then copied into the buffers."""

    fill = Backend.fill


@contextlib.contextmanager
def whole_object_fills():
    """S3 read through ``WholeObjectS3`` within the block (registered ahead of S3's own backend)."""
    whole = WholeObjectS3()
    backends.register(whole)
    try:
        yield whole
    finally:
        backends.unregister(whole)


@pytest.fixture
def manifest() -> Manifest:
    return make_manifest()


@pytest.fixture
def samples():
    return make_samples(25)


@pytest.fixture
def new_samples():
    """Factory: ``new_samples(n, **kw)`` -> deterministic random samples (see make_samples)."""
    return make_samples


@pytest.fixture
def new_manifest():
    """Factory: ``new_manifest(**kw)`` -> a small Manifest (see make_manifest)."""
    return make_manifest


@pytest.fixture
def write():
    """``write(url, manifest, samples, **writer_kwargs)`` -> the closed StoreWriter."""
    return write_samples


# --------------------------------------------------------------------------- the tiny offline target


@pytest.fixture(scope="session")
def tiny_dir():
    """The tiny Qwen3.5-architecture target (built once, cached)."""
    from hsstore.extract.tiny import tiny_target_dir

    return tiny_target_dir()


@pytest.fixture(scope="session")
def tok(tiny_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir)


def stub_like_rows(n_rows=100, stub_share=0.87):
    """The brief's failure in miniature: most rows are empty thinking + 'OK.', the rest real answers."""
    n_stub = round(n_rows * stub_share)
    rows = []
    for i in range(n_rows):
        question = {"role": "user", "content": f"Please handle request number {i} carefully."}
        if i < n_stub:
            answer = {"role": "assistant", "content": "OK.", "reasoning_content": ""}
        else:
            answer = {
                "role": "assistant",
                "content": f"Request {i} is handled: the steps were checked one by one and the result is correct.",
                "reasoning_content": f"Request {i} needs care. First read it, then check every step, then answer.",
            }
        rows.append({"id": f"r{i}", "source": "legacy", "messages": [question, answer]})
    return rows


@pytest.fixture
def stub_file(tmp_path):
    path = tmp_path / "legacy.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in stub_like_rows()))
    return path




# --------------------------------------------------------------------------- test tiers
# `python -m pytest -q` runs every test; `-m fast` runs those of no other tier, the run a developer makes while
# editing. Most marks come from the rules below, so a new test lands in its tier without being marked by hand:
#   s3    uses the s3_endpoint fixture (s3_store and the other S3 fixtures start from it), or is the "s3" case of
#         a parametrized test (one that asks for s3_store by name)
#   slow  starts another program (a fresh interpreter imports torch for seconds on a small machine): its code, or a
#         helper or fixture of tests/ it calls, names subprocess, torch.multiprocessing's spawn, the "spawn" start
#         method or ProcessWriter; or it is the "spawn" case of a parametrized test
# Marked by hand: `slow` on whole modules (pytestmark) and on tests that train, compile, serve, import the peers'
# packages or otherwise take seconds in-process; `browser` (headless Chromium); `gpu` (skipped where CUDA is absent).

TIERS = ("slow", "s3", "browser", "gpu")
STARTS_A_PROGRAM = {"subprocess", "spawn", "ProcessWriter"}
TESTS = Path(__file__).resolve().parent


def _words(code: types.CodeType) -> set[str]:
    """The names and string constants of a code object and of the functions nested in it."""
    words = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, str):
            words.add(const)
        elif isinstance(const, types.CodeType):
            words |= _words(const)
    return words


def _starts_a_program(fn, seen: set) -> bool:
    """Whether ``fn``, or a function of tests/ it names, holds one of STARTS_A_PROGRAM."""
    fn = inspect.unwrap(fn)
    code = getattr(fn, "__code__", None)
    if code is None or code in seen or not Path(code.co_filename).resolve().is_relative_to(TESTS):
        return False
    seen.add(code)
    words = _words(code)
    return bool(words & STARTS_A_PROGRAM) or any(
        _starts_a_program(fn.__globals__[w], seen) for w in words if callable(fn.__globals__.get(w)))


def tiers_by_rule(item: pytest.Item) -> set[str]:
    """The tiers ``item`` belongs to by the rules above."""
    tiers: set[str] = set()
    if not isinstance(item, pytest.Function):
        return tiers
    case = set(item.callspec.id.split("-")) if hasattr(item, "callspec") else set()
    if "s3_endpoint" in item.fixturenames or "s3" in case:
        tiers.add("s3")
    fixtures = [d.func for defs in item._fixtureinfo.name2fixturedefs.values() for d in defs]
    seen: set = set()
    if "spawn" in case or any(_starts_a_program(f, seen) for f in [item.function, *fixtures]):
        tiers.add("slow")
    return tiers


def pytest_configure(config: pytest.Config) -> None:
    """The tests' CPU threads by the commands' rule (``hsstore.app.threads``): their models are tiny, so one thread,
    within the cores this process may use; commands the tests start choose their own the same way."""
    import torch

    from hsstore.app.threads import default_threads, usable_cores

    torch.set_num_threads(default_threads(0, usable_cores()))


@pytest.hookimpl(tryfirst=True)  # before `-m` selects
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    for item in items:
        for tier in tiers_by_rule(item):
            item.add_marker(tier)
        if not any(item.get_closest_marker(t) for t in TIERS):
            item.add_marker("fast")
        if item.get_closest_marker("gpu") and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
