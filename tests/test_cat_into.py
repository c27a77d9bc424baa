"""``transfer.cat_into``: remote objects streamed straight into the reader's buffers, against moto's S3 server
on loopback (through the fault proxy where a fault is the point). Expected bytes are the objects as written."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import tracemalloc
import uuid

import numpy as np
import pytest
import s3fs

from hsstore.io import transfer

from hsstore.testing.ports import free_port
from hsstore.testing.faultproxy import FaultProxy

from conftest import whole_object_fills


@pytest.fixture
def bucket(s3_endpoint):
    """A fresh bucket holding ``a`` (3 MiB + 4 bytes, random) and ``b`` (10 bytes)."""
    name = f"hs-into-{uuid.uuid4().hex[:8]}"
    fs = s3fs.S3FileSystem(endpoint_url=s3_endpoint, skip_instance_cache=True)
    fs.mkdir(name)
    blobs = {"a": os.urandom((3 << 20) + 4), "b": b"0123456789"}
    for k, v in blobs.items():
        fs.pipe(f"{name}/{k}", v)
    return name, blobs


def s3(endpoint: str):
    return s3fs.S3FileSystem(endpoint_url=endpoint, skip_instance_cache=True)


def filled(streamed: bool):
    """S3's own ``fill`` (bodies streamed into the buffers), or the protocol's default that every backend without
    a streaming ``fill`` takes (each object fetched whole, then copied)."""
    return contextlib.nullcontext() if streamed else whole_object_fills()


def split(size: int, tail: int = 4):
    """A payload buffer and a tail buffer, as a chunk is read (payload, then its 4-byte CRC32C)."""
    return np.zeros(size - tail, np.uint8), bytearray(tail)


@pytest.mark.parametrize("streamed", [True, False], ids=["streamed", "cat_many"])
def test_objects_fill_their_buffers_in_turn(s3_endpoint, bucket, streamed):
    name, blobs = bucket
    pa, ta = split(len(blobs["a"]))
    pb, tb = split(len(blobs["b"]), tail=3)
    with filled(streamed):
        got = transfer.cat_into(s3(s3_endpoint), {f"{name}/a": [pa, ta], f"{name}/b": [pb, tb]})
    assert got == {f"{name}/a": None, f"{name}/b": None}
    assert pa.tobytes() + bytes(ta) == blobs["a"]
    assert pb.tobytes() + bytes(tb) == blobs["b"]


@pytest.mark.parametrize("streamed", [True, False], ids=["streamed", "cat_many"])
def test_missing_short_and_failing_objects_are_told_apart(s3_endpoint, bucket, monkeypatch, streamed):
    """A missing object is its FileNotFoundError; one shorter than its buffers, or failing ``check``, is a message
    (the bytes are wrong, not the path to them) after FETCH_ATTEMPTS fetches."""
    name, blobs = bucket
    monkeypatch.setattr(transfer, "FETCH_BACKOFF_S", 0.0)
    with FaultProxy(s3_endpoint, faults=[], limit=0) as proxy, filled(streamed):
        fs = s3(proxy.url)
        targets = {f"{name}/missing": [bytearray(8)], f"{name}/b": [bytearray(16)], f"{name}/a": list(split(len(blobs["a"])))}
        got = transfer.cat_into(fs, targets, check=lambda p: "bad" if p.endswith("/a") else None)
    assert isinstance(got[f"{name}/missing"], FileNotFoundError)
    assert got[f"{name}/b"] == "object ended early (10 of 16 bytes)"
    assert got[f"{name}/a"] == "bad"
    gets = [p for m, p in proxy.log if m == "GET"]
    assert sum(p.endswith("/a") for p in gets) == sum(p.endswith("/b") for p in gets) == transfer.FETCH_ATTEMPTS


def test_a_body_cut_in_transit_is_fetched_again(s3_endpoint, bucket, monkeypatch):
    """Faults the HTTP layer sees (reset mid-body, a body cut before its Content-Length) and the one it cannot
    see (a short body with a matching Content-Length, caught by the size) all end in the right bytes."""
    name, blobs = bucket
    monkeypatch.setattr(transfer, "FETCH_BACKOFF_S", 0.0)
    for kind in ("reset_mid", "truncate", "short"):
        with FaultProxy(s3_endpoint, faults=[kind], persistent=False, every=1, limit=1) as proxy:
            payload, tail = split(len(blobs["a"]))
            got = transfer.cat_into(s3(proxy.url), {f"{name}/a": [payload, tail]})
            assert proxy.injected[kind] == 1
        assert got == {f"{name}/a": None}, kind
        assert payload.tobytes() + bytes(tail) == blobs["a"], kind


@pytest.fixture(scope="module")
def moto_process(s3_endpoint):
    """An S3 endpoint served by moto in another process, so that this process traces only the client's memory."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("moto's server did not start")
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


def test_streamed_reads_hold_no_whole_body(moto_process, monkeypatch):
    """The point of streaming: no bytes object of the body's size exists on the way (traced allocations stay a
    fraction of the object), where fetching it whole first (the path of other filesystems) allocates the body and more."""
    s3_endpoint = moto_process
    name = f"hs-into-{uuid.uuid4().hex[:8]}"
    fs = s3(s3_endpoint)
    fs.mkdir(name)
    size = 16 << 20
    fs.pipe(f"{name}/big", os.urandom(size))
    dest = np.zeros(size, np.uint8)
    peaks = {}
    for mode in ("1", "0"):
        with filled(mode == "1"):
            client = s3(s3_endpoint)
            transfer.cat_into(client, {f"{name}/big": [dest[:1 << 20]]})  # the client is set up outside the trace
            tracemalloc.start()
            try:
                assert transfer.cat_into(client, {f"{name}/big": [dest]}) == {f"{name}/big": None}
                peaks[mode] = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
    assert peaks["0"] >= size, peaks  # the detector sees a whole body
    assert peaks["1"] < size // 4, peaks
